"""Refusals carry when to retry: gRPC trailing metadata `retry-after-ms` from a real
grpc.aio server, read back into the domain error; HTTP Retry-After from the gateway's
error response."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from easerve.errors import InvalidRequest, Overloaded, Unavailable
from easerve.rpc import errors
from easerve.wire.v1 import decode_pb2, decode_pb2_grpc
from tests.support.decode_server import with_decode_server


@pytest.mark.parametrize("exc,code,ms", [
    (Overloaded("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED, "1000"),
    (Overloaded("queue full", retry_after_s=2.5), grpc.StatusCode.RESOURCE_EXHAUSTED, "2500"),
    (Unavailable("restarting"), grpc.StatusCode.UNAVAILABLE, "1000"),
    (InvalidRequest("bad"), grpc.StatusCode.INVALID_ARGUMENT, None),
])
def test_refusals_carry_retry_after_ms_and_it_survives_the_hop(exc, code, ms):
    async def call(ch, servicer):
        servicer.raise_ = exc
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.StatsRequest(), timeout=5)
        assert ei.value.code() == code
        assert dict(ei.value.trailing_metadata() or ()).get(errors.RETRY_AFTER_KEY) == ms
        back = errors.from_rpc_error(ei.value)  # what the gateway re-raises to its own caller
        assert back.retry_after_s == (None if ms is None else int(ms) / 1000)
    asyncio.run(with_decode_server(call))


def test_http_error_has_retry_after_in_whole_seconds():
    from easerve.stages.gateway.http_api import _error
    assert _error(429, "full", 0.2).headers["Retry-After"] == "1"
    assert _error(503, "down", 2.5).headers["Retry-After"] == "3"
    assert "Retry-After" not in _error(400, "bad").headers
