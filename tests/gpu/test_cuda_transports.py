"""CUDA transports across processes. Needs CUDA (and 2 GPUs for NCCL); skipped otherwise."""
import asyncio
import multiprocessing as mp

import pytest
import torch

from easerve.wire import codec
from easerve.transport.base import handle_from_proto, handle_to_proto
from easerve.types import KVPayload, SamplingParams
from easerve.wire.v1 import kv_pb2
from tests.support.dist_pair import PAYLOADS, run_beside, run_pair

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def kv(i: int, device: str = "cpu") -> KVPayload:
    g = torch.Generator().manual_seed(i)
    mk = lambda: torch.randn(4, 64 + i, 128, generator=g).to(torch.bfloat16).to(device)  # noqa: E731
    return KVPayload(f"r{i}", [mk() for _ in range(3)], [mk() for _ in range(3)], prompt_len=64 + i,
                     rope_delta=i, first_token=i, sampling=SamplingParams(seed=i))


def assert_same_cpu(got: KVPayload, want: KVPayload) -> None:
    assert got.request_id == want.request_id
    for a, b in zip(got.keys + got.values, want.keys + want.values):
        assert torch.equal(a.cpu(), b.cpu())


def _ipc_receiver(conn) -> None:
    from easerve.transport.cuda_ipc import CudaIpcTransport

    async def main():
        t = CudaIpcTransport()
        while (msg := conn.recv()) is not None:
            handle = handle_from_proto(kv_pb2.KVTransfer.FromString(msg))
            header, tensors = await t.recv(handle)
            assert all(x.is_cuda for x in tensors)
            conn.send(codec.join_parts(header, tensors))  # moved to CPU bytes
    asyncio.run(main())


def test_cuda_ipc_across_processes():
    from easerve.transport.cuda_ipc import CudaIpcTransport

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_receiver, args=(child,), daemon=True)
    proc.start()

    async def main():
        t = CudaIpcTransport()
        for i in range(3):
            p = kv(i, "cuda")
            p.keys[0].mul_(2)  # written on the stream just before sending: ordering matters
            h = await t.send(p.request_id, *codec.kv_to_parts(p))
            parent.send(handle_to_proto(h).SerializeToString())
            assert parent.poll(120), "receiver did not answer"
            assert_same_cpu(codec.kv_from_parts(*codec.split_parts(parent.recv())), p)
            t.release(h)
        await t.close()
    run_beside(main, parent, proc, 60)


def test_cuda_ipc_same_process_and_shm_from_gpu():
    from easerve.transport.cuda_ipc import CudaIpcTransport
    from easerve.transport.shm import ShmTransport

    async def main():
        p = kv(7, "cuda")
        t = CudaIpcTransport()
        h = await t.send(p.request_id, *codec.kv_to_parts(p))
        assert_same_cpu(codec.kv_from_parts(*await t.recv(h)), p)
        s = ShmTransport()
        h2 = await s.send(p.request_id, *codec.kv_to_parts(p))  # CUDA tensors staged through host
        assert_same_cpu(codec.kv_from_parts(*await s.recv(h2)), p)
        await t.close()
        await s.close()
    asyncio.run(main())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL pair needs 2 GPUs")
def test_nccl_two_ranks_any_order():
    got = run_pair("nccl", kv, 180)
    for i, p in zip(reversed(range(PAYLOADS)), got):
        assert_same_cpu(p, kv(i))
