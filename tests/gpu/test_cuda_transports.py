"""CUDA transports across processes. Needs CUDA (and 2 GPUs for NCCL); skipped otherwise."""
import asyncio
import multiprocessing as mp
import socket

import pytest
import torch

from easerve.wire import codec
from easerve.transport.base import handle_from_proto, handle_to_proto
from easerve.types import KVPayload, SamplingParams
from easerve.wire.v1 import kv_pb2

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
    try:
        asyncio.run(main())
    finally:
        parent.send(None)
        proc.join(60)
    assert proc.exitcode == 0


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nccl_rank(rank: int, init: str, conn) -> None:
    from easerve.transport.nccl import NcclConfig, NcclTransport

    async def main():
        t = NcclTransport(NcclConfig(rank=rank, init_method=init, device=f"cuda:{rank}"))
        await t.connect()
        if rank == 0:
            for i in range(3):
                p = kv(i, "cuda:0")
                conn.send(handle_to_proto(await t.send(p.request_id, *codec.kv_to_parts(p))).SerializeToString())
        else:
            handles = [handle_from_proto(kv_pb2.KVTransfer.FromString(conn.recv())) for _ in range(3)]
            for h in reversed(handles):
                header, tensors = await t.recv(h, timeout=120)
                assert all(x.device == torch.device("cuda:1") for x in tensors)
                conn.send(codec.join_parts(header, tensors))
        conn.recv()
        await t.close()
    asyncio.run(main())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL pair needs 2 GPUs")
def test_nccl_two_ranks_any_order():
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{_free_port()}"
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_nccl_rank, args=(r, init, pipes[r][1]), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        sender, receiver = pipes[0][0], pipes[1][0]
        for _ in range(3):
            assert sender.poll(180), "sender produced no handle"
            receiver.send(sender.recv())
        for i in reversed(range(3)):
            assert receiver.poll(180), "receiver produced no payload"
            assert_same_cpu(codec.kv_from_parts(*codec.split_parts(receiver.recv())), kv(i))
    finally:
        for (conn, _), p in zip(pipes, procs):
            conn.send("done")
            p.join(60)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]


def _embed_receiver(conn) -> None:
    from easerve.transport.handoff import embedding_receiver

    async def main():
        recv = embedding_receiver("cuda")
        msg = kv_pb2.KVTransfer.FromString(conn.recv())
        got = codec.embeddings_from_parts(*await recv.fetch_parts(msg), "e1")
        conn.send(([x.is_cuda for x in got], [x.cpu() for x in got], dict(recv.received_bytes)))
    asyncio.run(main())


def test_embeddings_from_a_gpu_encoder_cross_cuda_ipc_without_leaving_the_gpu():
    """Auto choice on one GPU with shared memory: CUDA IPC; the receiver gets the encoder's own
    device tensors (no device-to-host copy), counted under cuda_ipc."""
    from easerve.transport.handoff import KVSenders
    from easerve.transport.node import local_identity

    me = local_identity("cuda")

    async def reach_of(addr):
        return me, True

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_embed_receiver, args=(child,), daemon=True)
    proc.start()

    async def main():
        senders = KVSenders(me, reach_of, byte_stream=False)
        embeds = [torch.randn(192, 3584, device="cuda").to(torch.bfloat16), torch.randn(5, 3584, device="cuda")]
        msg, t = await senders.send_parts("p:1", "e1", *codec.embeddings_to_parts("e1", embeds))
        assert msg.WhichOneof("location") == "cuda_ipc" and msg.ByteSize() < 4096
        parent.send(msg.SerializeToString())
        assert parent.poll(120), "receiver did not answer"
        on_gpu, got, counted = parent.recv()
        assert on_gpu == [True, True] and all(torch.equal(a, b.cpu()) for a, b in zip(got, embeds))
        nbytes = sum(e.numel() * e.element_size() for e in embeds)
        assert counted == {"cuda_ipc": nbytes} and senders.sent_bytes == {"cuda_ipc": nbytes}
        senders.release(t, msg)
        await senders.close()
    try:
        asyncio.run(main())
    finally:
        proc.join(60)
    assert proc.exitcode == 0
