"""A fake decode service on a real gRPC server (easerve.rpc.server.serve) on a free port."""
from __future__ import annotations

import asyncio

import grpc

from easerve.errors import Overloaded
from easerve.rpc import errors
from easerve.rpc.deadline import downstream_timeout
from easerve.rpc.server import serve
from easerve.wire.v1 import common_pb2, decode_pb2, decode_pb2_grpc


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    """Stats raises whatever `self.raise_` says; Open streams, then maybe fails."""

    def __init__(self):
        self.raise_ = None
        self.seen_timeout = "unset"

    @errors.grpc_errors
    async def Stats(self, request, context):
        self.seen_timeout = downstream_timeout(context)
        if self.raise_ is not None:
            raise self.raise_
        return decode_pb2.StatsResponse(running=1)

    @errors.grpc_errors
    async def Open(self, request, context):
        yield common_pb2.TokenChunk(request_id=request.meta.request_id, token_ids=[1])
        raise Overloaded("KV pool full and queue full")


async def with_decode_server(fn, *, warmup=None):
    servicer, stop, ports = FakeDecode(), asyncio.Event(), []
    task = asyncio.create_task(serve(
        [(decode_pb2_grpc.add_DecodeServicer_to_server, servicer)], "127.0.0.1:0",
        health_services=["easerve.v1.Decode"], warmup=warmup, stop=stop,
        grace_s=1.0, on_bound=ports.append))
    while not ports:
        await asyncio.sleep(0.01)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}") as ch:
            return await fn(ch, servicer)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
