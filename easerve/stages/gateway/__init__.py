"""The gateway stage: its loop, servicer and process assembly (`app`)."""
