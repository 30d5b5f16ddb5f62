"""EAServe: encode-aware disaggregated serving for multimodal LLMs.

`import easerve` stays light: the SDK (`Client`, `AsyncClient`, results, typed errors) is
imported from `easerve.client` on first access.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {name: "easerve.client" for name in (
    "Client", "AsyncClient", "Completion", "Chunk", "Usage", "Timings", "ModelInfo", "Stream", "AsyncStream",
    "EAServeError", "InvalidRequestError", "NotFoundError", "OverloadedError", "UnavailableError",
    "DeadlineExceededError", "RequestCancelled", "InternalError", "UnauthenticatedError",
    "MessageTooLargeError",
)}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'easerve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
