"""Transports across real process boundaries (multiprocessing spawn: fresh interpreters)."""
import asyncio
import multiprocessing as mp
import os
import socket

import pytest
import torch

from easerve.wire import codec
from easerve.transport.base import handle_from_proto, handle_to_proto
from easerve.transport.shm import ShmConfig, ShmTransport
from easerve.types import KVPayload, SamplingParams
from easerve.wire.v1 import kv_pb2

PREFIX = "easerve-x"


def kv(i: int) -> KVPayload:
    g = torch.Generator().manual_seed(i)
    mk = lambda: torch.randn(2, 4 + i, 16, generator=g).to(torch.bfloat16)  # noqa: E731
    return KVPayload(f"r{i}", [mk(), mk()], [mk(), mk()], prompt_len=4 + i, rope_delta=i,
                     first_token=i, sampling=SamplingParams(seed=i))


def _shm_receiver(conn) -> None:
    async def main():
        t = ShmTransport(ShmConfig(prefix=PREFIX))
        while (msg := conn.recv()) is not None:
            handle = handle_from_proto(kv_pb2.KVTransfer.FromString(msg))
            conn.send(codec.join_parts(*await t.recv(handle)))
    asyncio.run(main())


@pytest.mark.parametrize("slab_bytes", [1 << 20, 0])
def test_shm_across_processes_no_leak(slab_bytes):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_shm_receiver, args=(child,), daemon=True)
    proc.start()
    before = {n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)}

    async def main():
        t = ShmTransport(ShmConfig(prefix=PREFIX, slab_bytes=slab_bytes))
        for i in range(3):
            p = kv(i)
            h = await t.send(p.request_id, *codec.kv_to_parts(p))
            assert h.slab == bool(slab_bytes)
            parent.send(handle_to_proto(h).SerializeToString())
            assert parent.poll(120), "receiver did not answer"
            got = codec.kv_from_parts(*codec.split_parts(parent.recv()))
            assert got.request_id == p.request_id and got.rope_delta == i
            assert all(torch.equal(a, b) for a, b in zip(got.keys + got.values, p.keys + p.values))
            t.release(h)
        if slab_bytes:  # the receiver dropped its views: every region comes back
            for _ in range(100):
                t._slab.reclaim()
                if t._slab.used_bytes == 0:
                    break
                await asyncio.sleep(0.05)
            assert t._slab.used_bytes == 0
        await t.close()
    try:
        asyncio.run(main())
    finally:
        parent.send(None)
        proc.join(30)
    assert proc.exitcode == 0
    assert {n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)} == before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_rank(rank: int, init: str, conn) -> None:
    from easerve.transport.nccl import NcclConfig, NcclTransport

    async def main():
        t = NcclTransport(NcclConfig(rank=rank, init_method=init, backend="gloo", device="cpu"))
        await t.connect()
        if rank == 0:
            for i in range(3):
                p = kv(i)
                conn.send(handle_to_proto(await t.send(p.request_id, *codec.kv_to_parts(p))).SerializeToString())
        else:
            handles = [handle_from_proto(kv_pb2.KVTransfer.FromString(conn.recv())) for _ in range(3)]
            for h in reversed(handles):  # any order: payloads are parked by tag
                conn.send(codec.join_parts(*await t.recv(h, timeout=60)))
        conn.recv()  # wait until the test is done before tearing the group down
        await t.close()
    asyncio.run(main())


@pytest.mark.slow
def test_dist_transport_with_gloo_any_order():
    """The NCCL transport's protocol on CPU (gloo backend): same code path as nccl."""
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{_free_port()}"
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_dist_rank, args=(r, init, pipes[r][1]), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        sender, receiver = pipes[0][0], pipes[1][0]
        for _ in range(3):
            assert sender.poll(120), "sender produced no handle"
            receiver.send(sender.recv())
        for i in reversed(range(3)):
            assert receiver.poll(120), "receiver produced no payload"
            got, want = codec.kv_from_parts(*codec.split_parts(receiver.recv())), kv(i)
            assert got.request_id == want.request_id
            assert all(torch.equal(a, b) for a, b in zip(got.keys + got.values, want.keys + want.values))
    finally:
        for (conn, _), p in zip(pipes, procs):  # sender first: its goodbye ends the receiver
            conn.send("done")
            p.join(30)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
