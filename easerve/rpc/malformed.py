"""Requests whose bytes are not the method's protobuf: INVALID_ARGUMENT naming the message type.

grpc answers a request its deserializer cannot parse with UNKNOWN ("Unexpected DecodeError"),
which reads as a server bug. `register` adds a generated `add_XServicer_to_server`'s handlers
with a deserializer that turns a parse failure into a `Malformed` marker, and a behaviour that
aborts the call with INVALID_ARGUMENT on seeing one (for streamed requests: at the bad message).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import grpc
from google.protobuf.message import DecodeError


class Malformed:
    """Stands in for a request message that did not parse."""

    def __init__(self, message: str):
        self.message = message


def safe_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None
    name = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    what = name.full_name if name is not None else "request"

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except (DecodeError, RecursionError) as e:
            return Malformed(f"the request is not a valid {what} protobuf ({len(raw)} bytes: {e}); "
                             "build it from protos/easerve/v1")
    return parse


async def _abort(context, bad: Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad.message)


def _unary_request(behavior):
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            if isinstance(request, Malformed):
                await _abort(context, request)
            async for item in behavior(request, context):
                yield item
        return stream

    async def unary(request, context):
        if isinstance(request, Malformed):
            await _abort(context, request)
        return await behavior(request, context)
    return unary


def _checked(requests, context):
    async def each():
        async for r in requests:
            if isinstance(r, Malformed):
                await _abort(context, r)
            yield r
    return each()


def _stream_request(behavior):
    if inspect.isasyncgenfunction(behavior):
        async def stream(requests, context):
            async for item in behavior(_checked(requests, context), context):
                yield item
        return stream

    async def unary(requests, context):
        return await behavior(_checked(requests, context), context)
    return unary


def strict_handler(h: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The same handler, answering unparseable requests with INVALID_ARGUMENT."""
    kind = ("stream" if h.request_streaming else "unary") + "_" + ("stream" if h.response_streaming else "unary")
    wrap = _stream_request if h.request_streaming else _unary_request
    return h._replace(request_deserializer=safe_deserializer(h.request_deserializer),
                      **{kind: wrap(getattr(h, kind))})


class _Capture:
    """What a generated add_XServicer_to_server hands to the server, kept aside."""

    def __init__(self) -> None:
        self.services: list[tuple[str, dict]] = []

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.services.append((service, handlers))

    def add_generic_rpc_handlers(self, _handlers) -> None:
        pass  # rebuilt from the registered handlers


def register(add: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server) -> None:
    """`add(servicer, server)`, every method made strict about its request bytes."""
    cap = _Capture()
    add(servicer, cap)
    if not cap.services:  # not a generated adder: leave it as it is
        add(servicer, server)
        return
    for service, handlers in cap.services:
        strict = {name: strict_handler(h) for name, h in handlers.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, strict),))
        server.add_registered_method_handlers(service, strict)
