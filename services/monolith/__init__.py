"""Encode, prefill and decode in one process: the aggregated (vLLM-like) baseline."""
