"""Domain errors (`easerve.errors`) on the wire: gRPC status codes, trailing metadata and
HTTP statuses, in one table.

Servicer methods wrap themselves with `@grpc_errors`; clients turn an `AioRpcError` back
into a domain error with `from_rpc_error`; the HTTP front end maps with `domain_error`
(its `.http` status and `.retry_after_s`). An error class with a `reason` travels as that
reason code in trailing metadata (`REASON_KEY`) and comes back as the same class, so a
caller acts on the code, never on the words of the message.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import re
from typing import Any, Callable

import grpc

from easerve.errors import (CacheMiss, Cancelled, DeadlineExceeded, EAServeError, Internal, InvalidRequest,
                            MessageTooLarge, NotFound, Overloaded, Unauthenticated, Unavailable)

log = logging.getLogger(__name__)


def status_code(err: EAServeError) -> grpc.StatusCode:
    return grpc.StatusCode[err.code]


# Builtin exceptions that stand for a domain error: TimeoutError (asyncio.TimeoutError too).
# A bare ValueError is NOT one: only `InvalidRequest` (CodecError, MediaError, SamplingParams
# validation, ...) blames the caller; any other ValueError is a bug here, INTERNAL / 500.
_BUILTIN: tuple[tuple[type[BaseException], type[EAServeError]], ...] = (
    (TimeoutError, DeadlineExceeded),
)
_BY_CODE: dict[grpc.StatusCode, type[EAServeError]] = {
    grpc.StatusCode[c.code]: c for c in (InvalidRequest, NotFound, Overloaded, Unavailable, DeadlineExceeded,
                                         Cancelled, Internal, Unauthenticated)
}
# the classes a reason code in trailing metadata stands for
_BY_REASON: dict[str, type[EAServeError]] = {c.reason: c for c in (CacheMiss,)}
# gRPC core's words for a message over a channel's or server's max message length
_TOO_LARGE = re.compile(r"(Received|Sent) message larger than max \((\d+) vs\. (\d+)\)")


def domain_error(exc: BaseException) -> EAServeError:
    """The domain error an exception stands for (anything unknown becomes Internal)."""
    if isinstance(exc, EAServeError):
        return exc
    if isinstance(exc, grpc.RpcError):
        return from_rpc_error(exc)
    for base, cls in _BUILTIN:
        if isinstance(exc, base):
            return cls(str(exc) or type(exc).__name__)
    return Internal(f"internal error ({type(exc).__name__})")


def http_status(exc: BaseException) -> int:
    return domain_error(exc).http


def is_unexpected(exc: BaseException) -> bool:
    """Whether `exc` is a bug (it maps to INTERNAL without being a domain error): log its traceback."""
    return not isinstance(exc, (EAServeError, grpc.RpcError)) and domain_error(exc).code == "INTERNAL"


RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of a refusal: when to try again
REASON_KEY = "easerve-reason"       # trailing metadata: the error's reason code (EAServeError.reason)


def status_metadata(err: EAServeError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that carries `err.retry_after_s` and `err.reason` (each when set)."""
    meta: list[tuple[str, str]] = []
    if err.retry_after_s is not None:
        meta.append((RETRY_AFTER_KEY, str(max(0, round(err.retry_after_s * 1000)))))
    if err.reason is not None:
        meta.append((REASON_KEY, err.reason))
    return tuple(meta)


def _trailing(err: grpc.RpcError) -> dict[str, str]:
    meta = err.trailing_metadata() if callable(getattr(err, "trailing_metadata", None)) else None
    return {key: value for key, value in meta or () if isinstance(value, str)}


def _retry_after_s(meta: dict[str, str]) -> float | None:
    try:
        return max(0.0, int(meta[RETRY_AFTER_KEY]) / 1000)
    except (KeyError, ValueError):
        return None  # none sent, or a peer's malformed hint: the class default stands


def from_rpc_error(err: grpc.RpcError) -> EAServeError:
    """Client side: a downstream status becomes the matching domain error (the class its
    reason code names, else the one of its status code; with the peer's retry hint, when
    it sent one)."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    big = _TOO_LARGE.search(details or "") if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
    if big is not None:
        return MessageTooLarge(f"a message of {big[2]} bytes is over the gRPC limit of {big[3]} bytes "
                               f"(--max-message-mb of the process that {big[1].lower()} it); "
                               "send smaller media or raise that limit")
    meta = _trailing(err)
    cls = _BY_REASON.get(meta.get(REASON_KEY, ""))
    if cls is None or grpc.StatusCode[cls.code] != code:  # a reason sent with another code means nothing
        cls = _BY_CODE.get(code, Internal)
    return cls(details or code.name, retry_after_s=_retry_after_s(meta))


def from_peer_error(err: grpc.RpcError) -> EAServeError:
    """`from_rpc_error` of a call this process made to another stage over grpc.aio, where a
    call it cancels itself raises asyncio.CancelledError: a CANCELLED status came from the peer
    (it stopped, or was stopped, with the call open), so it is Unavailable, to retry elsewhere."""
    code = err.code() if callable(getattr(err, "code", None)) else None
    if code == grpc.StatusCode.CANCELLED:
        return Unavailable(f"the call was cut at the peer ({err.details() or 'CANCELLED'}); retry it elsewhere")
    return from_rpc_error(err)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    err = domain_error(exc)
    if is_unexpected(exc):
        log.error("unhandled error in servicer", exc_info=exc)
    await context.abort(status_code(err), str(err), trailing_metadata=status_metadata(err))


def grpc_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a servicer method (`async def` or async generator) taking (self, request, context):
    domain errors and timeouts abort the call with their status code; anything else is INTERNAL,
    its traceback logged."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - mapped in one place
                await abort_with(context, exc)
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - mapped in one place
            await abort_with(context, exc)
    return unary
