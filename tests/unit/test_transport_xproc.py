"""Transports across real process boundaries (multiprocessing spawn: fresh interpreters)."""
import asyncio
import multiprocessing as mp
import os

import pytest
import torch

from easerve.wire import codec
from easerve.transport.base import handle_from_proto, handle_to_proto
from easerve.transport.shm import ShmConfig, ShmTransport
from easerve.types import KVPayload, SamplingParams
from easerve.wire.v1 import kv_pb2
from tests.support.dist_pair import PAYLOADS, run_beside, run_pair

PREFIX = "easerve-x"


def kv(i: int, device: str = "cpu") -> KVPayload:
    g = torch.Generator().manual_seed(i)
    mk = lambda: torch.randn(2, 4 + i, 16, generator=g).to(torch.bfloat16).to(device)  # noqa: E731
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
    run_beside(main, parent, proc, 30)
    assert {n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)} == before


@pytest.mark.slow
def test_dist_transport_with_gloo_any_order():
    """The NCCL transport's protocol on CPU (gloo backend): same code path as nccl."""
    got = run_pair("gloo", kv, 120)
    for i, p in zip(reversed(range(PAYLOADS)), got):
        want = kv(i)
        assert p.request_id == want.request_id
        assert all(torch.equal(a, b) for a, b in zip(p.keys + p.values, want.keys + want.values))
