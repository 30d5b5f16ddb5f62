"""The domain errors every part of EAServe raises, with the status each one surfaces as.

The one import path for them: every module imports a domain error class from here
(tests/unit/test_error_imports.py walks the imports). No grpc and no torch here: the engine
and the policies raise these, and `easerve.rpc.errors` maps them to gRPC status codes (by
name), trailing metadata and HTTP statuses.
"""
from __future__ import annotations


class EAServeError(Exception):
    """Base of the domain errors; `code` (a grpc.StatusCode name) / `http` say how each
    surfaces on the wire; `retry_after_s`, when set, tells the caller when to try again
    (HTTP `Retry-After`, gRPC trailing metadata `retry-after-ms`)."""

    code = "INTERNAL"
    http = 500
    retry_after_s: float | None = None
    # a reason code a caller acts on (gRPC trailing metadata `easerve-reason`): a class that
    # sets one is rebuilt as itself across gRPC, whatever its message says
    reason: str | None = None

    def __init__(self, *args, retry_after_s: float | None = None):
        super().__init__(*args)
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    def where(self, context: str) -> EAServeError:
        """The same error (class and retry hint) with `context` (who answered it, how far the
        request got) in front of its message."""
        return type(self)(f"{context}: {self}", retry_after_s=self.retry_after_s)


class InvalidRequest(EAServeError, ValueError):
    code, http = "INVALID_ARGUMENT", 400


class BadRequest(InvalidRequest):
    """Client error at the gateway's HTTP / gRPC front: the message says what to change."""


class MediaError(InvalidRequest):
    """User media that cannot be used; the message says what is accepted instead."""


class CodecError(InvalidRequest):
    """A payload that cannot be encoded or decoded; the message says what is wrong
    (an InvalidRequest, hence a ValueError: the bytes came from a caller)."""


class NotFound(EAServeError):
    code, http = "NOT_FOUND", 404


class CacheMiss(NotFound):
    """A media item came without its inputs (pixels) for a content hash this encode
    instance does not hold (evicted, or another instance): resend the item with inputs.
    Recognised by its reason code, never by its words."""
    reason = "ENCODER_CACHE_MISS"

    @classmethod
    def of_item(cls, index: int, modality: str, why: str) -> CacheMiss:
        return cls(f"encoder cache miss: item {index} ({modality}) {why}; resend the item with its inputs")


class Overloaded(EAServeError):
    """No room now (a full queue, an in-flight limit): retry later."""
    code, http = "RESOURCE_EXHAUSTED", 429
    retry_after_s = 1.0


class Unavailable(EAServeError):
    """A stage is down, restarting or draining: retry later (here or on another instance)."""
    code, http = "UNAVAILABLE", 503
    retry_after_s = 1.0


class EngineFailed(Unavailable):
    """The decode engine's step raised: this instance cannot finish the request."""


class DecodeStalled(Unavailable):
    """A decode stream sent no token for longer than the gateway's --decode-progress-timeout-s."""


class DeadlineExceeded(EAServeError, TimeoutError):
    code, http = "DEADLINE_EXCEEDED", 504


class Cancelled(EAServeError):
    code, http = "CANCELLED", 499  # nginx's "client closed request"


class Internal(EAServeError):
    pass


class BadUpstream(Internal):
    """A stage answered against the protocol (a stream that ended without a finish reason):
    the answer is cut short, HTTP 502."""
    http = 502


class Unauthenticated(EAServeError):
    """No valid API key (the gateway's --api-key)."""
    code, http = "UNAUTHENTICATED", 401


class MessageTooLarge(InvalidRequest):
    """A gRPC message over a process's --max-message-mb: never fits, so not a retry-later."""
    http = 413


class RequestTooLarge(InvalidRequest):
    """prompt_len + max_tokens can never fit the engine's KV memory."""
