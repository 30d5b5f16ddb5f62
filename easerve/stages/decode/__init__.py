"""The decode stage: its loop, servicer and process assembly (`app`)."""
