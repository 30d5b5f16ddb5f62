import asyncio

import grpc
import pytest
import torch

from easerve.wire import codec
from easerve.errors import DeadlineExceeded
from easerve.transport.base import (CudaIpcHandle, CudaTensorRef, GrpcHandle, InlineHandle,
                                    NcclHandle, ShmHandle, handle_from_proto, handle_to_proto)
from easerve.transport.grpc_stream import GrpcStreamConfig, GrpcStreamTransport, KVStreamServicer
from easerve.transport.inline import InlineTransport
from easerve.transport.shm import ShmConfig, ShmTransport
from easerve.types import KVPayload
from easerve.wire.v1 import kv_pb2, kv_pb2_grpc
from tests.support.kv import kv, roundtrip


def same(a: KVPayload, b: KVPayload) -> bool:
    return a.request_id == b.request_id and all(
        torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


async def _grpc_pair(fn, config=GrpcStreamConfig(chunk_bytes=4096)):
    servicer = KVStreamServicer(config)
    server = grpc.aio.server()
    kv_pb2_grpc.add_KVStreamServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    tx = GrpcStreamTransport(peer=f"127.0.0.1:{port}", config=config)
    rx = GrpcStreamTransport(servicer=servicer, config=config)
    try:
        return await fn(tx, rx, servicer, port)
    finally:
        await tx.close()
        await server.stop(0)


def test_grpc_stream_roundtrip_chunked():
    async def run(tx, rx, servicer, port):
        p = kv(tokens=40, layers=4)  # ~20 KB in 4 KiB chunks
        handle, got = await roundtrip(tx, rx, p)
        assert isinstance(handle, GrpcHandle) and handle.endpoint.endswith(str(port))
        assert same(got, p) and servicer.parked_bytes == 0
        with pytest.raises(DeadlineExceeded):  # taken once
            await rx.recv(handle, timeout=0.05)
    asyncio.run(_grpc_pair(run))


def test_grpc_stream_concurrent_and_out_of_order():
    async def run(tx, rx, servicer, port):
        ps = [kv(tokens=3 + i, rid=f"r{i}") for i in range(4)]
        handles = await asyncio.gather(*(tx.send(p.request_id, *codec.kv_to_parts(p)) for p in ps))
        for p, h in reversed(list(zip(ps, handles))):
            assert same(codec.kv_from_parts(*await rx.recv(h)), p)
    asyncio.run(_grpc_pair(run))


def test_grpc_stream_release_park_ttl_and_bad_pushes():
    async def run(tx, rx, servicer, port):
        h = await tx.send("r", *codec.kv_to_parts(kv()))
        rx.release(h)
        assert servicer.parked_bytes == 0
        await tx.send("old", *codec.kv_to_parts(kv()), timeout=0.05)  # parked until its deadline
        await asyncio.sleep(0.1)
        await tx.send("new", *codec.kv_to_parts(kv()))  # sweep drops "old"
        assert len(servicer._parked) == 1
        stub = kv_pb2_grpc.KVStreamStub(tx._channel)

        async def short():
            yield kv_pb2.KVChunk(key="k", total_bytes=10, data=b"abc")
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Push(short())
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "3 of 10" in ei.value.details()

        async def huge():  # can never be parked here: the sender's mistake, not a reason to retry
            yield kv_pb2.KVChunk(key="k", total_bytes=1 << 40)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Push(huge())
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "parks at most" in ei.value.details()

        async def no_room_now():  # fits the limit, not beside what is parked: retry later
            yield kv_pb2.KVChunk(key="k", total_bytes=(1 << 30) - servicer.parked_bytes + 1)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await stub.Push(no_room_now())
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    asyncio.run(_grpc_pair(run, GrpcStreamConfig(chunk_bytes=4096, max_parked_bytes=1 << 30)))


def test_inline_and_wrong_handle_kind():
    async def main():
        t = InlineTransport()
        p = kv()
        h, got = await roundtrip(t, t, p)
        assert isinstance(h, InlineHandle) and same(got, p)
        with pytest.raises(ValueError, match="shm transport cannot receive a InlineHandle"):
            await ShmTransport(ShmConfig(slab_bytes=0)).recv(h)
    asyncio.run(main())


def test_handle_proto_roundtrip_all_kinds():
    ref = CudaTensorRef("bfloat16", (2, 3), (3, 1), 0, 1, b"h" * 64, 4096, 512, b"rc", 8, b"ev", True)
    handles = [InlineHandle("a", b"xyz"), ShmHandle("a", "easerve-1", 0, 99),
               ShmHandle("a", "easerve-slab-1", 64, 99, slab=True, generation=5),
               GrpcHandle("a", "host:1", "a/k", 7), NcclHandle("a", 0, 1, 42, 1000, "host-1-ab"),
               CudaIpcHandle("a", b"{}", (ref, ref), b"e" * 64, 1, 24)]
    for h in handles:
        assert handle_from_proto(kv_pb2.KVTransfer.FromString(handle_to_proto(h).SerializeToString())) == h
    with pytest.raises(ValueError, match="no location"):
        handle_from_proto(kv_pb2.KVTransfer(request_id="z"))


def test_config_validation():
    with pytest.raises(ValueError, match="prefix"):
        ShmConfig(prefix="a/b")
    with pytest.raises(ValueError, match="chunk_bytes"):
        GrpcStreamConfig(chunk_bytes=1)
