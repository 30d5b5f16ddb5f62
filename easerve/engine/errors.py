"""Domain errors of the decode engine (mapped to RPC status codes in one place, `easerve.rpc`)."""
from __future__ import annotations


class Overloaded(RuntimeError):
    """The waiting queue is full: the caller should retry later (RESOURCE_EXHAUSTED)."""


class RequestTooLarge(ValueError):
    """prompt_len + max_tokens can never fit this engine's KV memory (INVALID_ARGUMENT)."""
