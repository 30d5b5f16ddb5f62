"""The monolith stage: its loop, servicer and process assembly (`app`)."""
