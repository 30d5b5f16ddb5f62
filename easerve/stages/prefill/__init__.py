"""The prefill stage: its loop, servicer and process assembly (`app`)."""
