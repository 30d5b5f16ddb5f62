"""Mechanisms that realise an SM / core partition (green contexts, MPS, CPU affinity, time-slicing); torch imported lazily."""
