"""The drain every stage shares: a server interceptor that knows the calls in flight.

While serving it only counts the calls that do work (not health checks, nor the
`easerve.v1.Stage` load polls). Once `begin()` is called (SIGTERM):
- a new call is refused UNAVAILABLE at once ("draining: place it on another instance"), so
  its caller retries elsewhere, unless its method is in `allow` (calls that finish work the
  stage accepted before the drain, e.g. decode's Submit of a reservation it holds);
- `idle()` returns once every accepted call has ended, however long its queue: each one
  ends by its own deadline at the latest;
- `cut(reason)` (the drain's hard bound passed) ends those still open with UNAVAILABLE,
  never CANCELLED, so their callers retry them on another instance.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Collection

import grpc

log = logging.getLogger(__name__)

# Calls that are not work: answered while draining, never waited for.
UNTRACKED_PREFIXES = ("/grpc.health.v1.Health/", "/easerve.v1.Stage/", "/grpc.reflection.")


class _Call:
    __slots__ = ("task", "cut", "answered")

    def __init__(self, task: asyncio.Task | None):
        self.task, self.cut, self.answered = task, False, False


class Drain(grpc.aio.ServerInterceptor):
    def __init__(self, allow: Collection[str] = ()):
        """`allow`: methods still taken while draining: full names ("/easerve.v1.Decode/Submit")
        or a whole service ("/easerve.v1.Prefill/")."""
        self.allow = frozenset(allow)
        self.draining = False
        self._open: set[_Call] = set()
        self._changed = asyncio.Event()
        self._reason = ""
        self.answered = 0  # accepted calls that answered: a unary's response, a stream's first message

    @property
    def inflight(self) -> int:
        """Accepted calls not ended yet."""
        return len(self._open)

    def begin(self) -> None:
        """Refuse new calls (but `allow`) from now on."""
        self.draining = True

    async def idle(self) -> None:
        """Return once no accepted call is open (after `begin()`, none comes but `allow`ed ones)."""
        while self._open:
            self._changed.clear()
            await self._changed.wait()

    def cut(self, reason: str) -> int:
        """End every open call with UNAVAILABLE `reason`; how many there were."""
        self._reason = reason
        open_ = [c for c in self._open if c.task is not None and not c.task.done()]
        for c in open_:
            c.cut = True
            c.task.cancel()
        return len(open_)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(UNTRACKED_PREFIXES):
            return handler
        refuse = self.draining and not self.allows(details.method)
        return _wrap(handler, self, refuse)

    def allows(self, method: str) -> bool:
        return method in self.allow or method[:method.rindex("/") + 1] in self.allow

    def _enter(self) -> _Call:
        c = _Call(asyncio.current_task())
        self._open.add(c)
        return c

    def _exit(self, c: _Call) -> None:
        self._open.discard(c)
        self.answered += c.answered
        self._changed.set()

    async def _cut_off(self, c: _Call, context) -> None:
        """A call the drain cut (`cut()` cancelled its task): it ends UNAVAILABLE."""
        c.task.uncancel()
        await context.abort(grpc.StatusCode.UNAVAILABLE, self._reason)


REFUSAL = "this instance is draining (shutting down): it takes no new calls; place the call on another instance"


def _guard_unary(behavior, drain: Drain, refuse: bool):
    async def unary(request_or_iterator, context):
        if refuse:
            await context.abort(grpc.StatusCode.UNAVAILABLE, REFUSAL)
        c = drain._enter()
        try:
            result = await behavior(request_or_iterator, context)
            c.answered = True
            return result
        except asyncio.CancelledError:
            if not c.cut:  # the caller went away (or the server stopped)
                raise
            await drain._cut_off(c, context)
        finally:
            drain._exit(c)
    return unary


def _guard_stream(behavior, drain: Drain, refuse: bool):
    async def stream(request_or_iterator, context):
        if refuse:
            await context.abort(grpc.StatusCode.UNAVAILABLE, REFUSAL)
        c = drain._enter()
        try:
            async for item in behavior(request_or_iterator, context):
                c.answered = True  # its caller may end the stream once it has what it needs
                yield item
        except asyncio.CancelledError:
            if not c.cut:  # the caller went away (or the server stopped)
                raise
            await drain._cut_off(c, context)
        finally:
            drain._exit(c)
    return stream


_KINDS = (("unary_unary", grpc.unary_unary_rpc_method_handler), ("unary_stream", grpc.unary_stream_rpc_method_handler),
          ("stream_unary", grpc.stream_unary_rpc_method_handler),
          ("stream_stream", grpc.stream_stream_rpc_method_handler))


def _wrap(handler: grpc.RpcMethodHandler, drain: Drain, refuse: bool) -> grpc.RpcMethodHandler:
    for kind, make in _KINDS:
        behavior = getattr(handler, kind)
        if behavior is None:
            continue
        guard = _guard_stream if inspect.isasyncgenfunction(behavior) else _guard_unary
        return make(guard(behavior, drain, refuse), request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)
    return handler
