"""The encode stage: its loop, servicer and process assembly (`app`)."""
