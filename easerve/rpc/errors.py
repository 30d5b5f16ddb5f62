"""Domain errors and their gRPC / HTTP status codes, in one table.

Servicer methods wrap themselves with `@grpc_errors`; clients turn an `AioRpcError` back
into a domain error with `from_rpc_error`; the HTTP front end maps with `domain_error`
(its `.http` status and `.retry_after_s`).
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import re
from typing import Any, Callable

import grpc

log = logging.getLogger(__name__)


from easerve.errors import (Cancelled, DeadlineExceeded, EAServeError, Internal, InvalidRequest,  # noqa: F401
                            MessageTooLarge, NotFound, Overloaded, RequestTooLarge, Unauthenticated,
                            Unavailable)


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


def retry_metadata(err: EAServeError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that carries `err.retry_after_s` (none when it is unset)."""
    if err.retry_after_s is None:
        return ()
    return ((RETRY_AFTER_KEY, str(max(0, round(err.retry_after_s * 1000)))),)


def _retry_after_s(err: grpc.RpcError) -> float | None:
    meta = err.trailing_metadata() if callable(getattr(err, "trailing_metadata", None)) else None
    for key, value in meta or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None  # a peer's malformed hint: the class default stands
    return None


def from_rpc_error(err: grpc.RpcError) -> EAServeError:
    """Client side: a downstream status becomes the matching domain error (with the
    peer's retry hint, when it sent one)."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    big = _TOO_LARGE.search(details or "") if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
    if big is not None:
        return MessageTooLarge(f"a message of {big[2]} bytes is over the gRPC limit of {big[3]} bytes "
                               f"(--max-message-mb of the process that {big[1].lower()} it); "
                               "send smaller media or raise that limit")
    return _BY_CODE.get(code, Internal)(details or code.name, retry_after_s=_retry_after_s(err))


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    err = domain_error(exc)
    if is_unexpected(exc):
        log.error("unhandled error in servicer", exc_info=exc)
    await context.abort(status_code(err), str(err), trailing_metadata=retry_metadata(err))


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
