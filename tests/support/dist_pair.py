"""Two processes joined by easerve.transport.nccl (nccl on two GPUs, or gloo on CPU): rank 0
sends three KV payloads, rank 1 receives them in the reverse order (payloads are parked by tag)."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket

import torch

from easerve.transport.base import handle_from_proto, handle_to_proto
from easerve.types import KVPayload
from easerve.wire import codec
from easerve.wire.v1 import kv_pb2

PAYLOADS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_rank(rank: int, init: str, conn, backend: str, make_kv) -> None:
    """One rank (a spawned process): rank 0 sends make_kv(i, device) for each i and passes the
    handles up `conn`; rank 1 takes the handles from `conn` and sends back what it received."""
    from easerve.transport.nccl import NcclConfig, NcclTransport
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"

    async def main():
        t = NcclTransport(NcclConfig(rank=rank, init_method=init, backend=backend, device=device))
        await t.connect()
        if rank == 0:
            for i in range(PAYLOADS):
                p = make_kv(i, device)
                conn.send(handle_to_proto(await t.send(p.request_id, *codec.kv_to_parts(p))).SerializeToString())
        else:
            handles = [handle_from_proto(kv_pb2.KVTransfer.FromString(conn.recv())) for _ in range(PAYLOADS)]
            for h in reversed(handles):  # any order: payloads are parked by tag
                header, tensors = await t.recv(h, timeout=120)
                assert all(x.device == torch.device(device) for x in tensors)
                conn.send(codec.join_parts(header, tensors))
        conn.recv()  # wait until the test is done before tearing the group down
        await t.close()
    asyncio.run(main())


def run_pair(backend: str, make_kv, timeout_s: float) -> list[KVPayload]:
    """Both ranks, the handles relayed from rank 0 to rank 1: the payloads rank 1 received, in
    the order it received them (PAYLOADS - 1 down to 0). Both ranks must exit cleanly."""
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{free_port()}"
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=dist_rank, args=(r, init, pipes[r][1], backend, make_kv), daemon=True)
             for r in (0, 1)]
    for p in procs:
        p.start()
    got = []
    try:
        sender, receiver = pipes[0][0], pipes[1][0]
        for _ in range(PAYLOADS):
            assert sender.poll(timeout_s), "sender produced no handle"
            receiver.send(sender.recv())
        for _ in range(PAYLOADS):
            assert receiver.poll(timeout_s), "receiver produced no payload"
            got.append(codec.kv_from_parts(*codec.split_parts(receiver.recv())))
    finally:
        for (conn, _), p in zip(pipes, procs):  # sender first: its goodbye ends the receiver
            conn.send("done")
            p.join(60)
            if p.exitcode is None:
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return got


def run_beside(main, parent, proc, join_s: float = 60.0) -> None:
    """asyncio.run(main()) while the spawned `proc` answers over the pipe end `parent`; then
    tell it to stop (None) and check that it exited cleanly."""
    try:
        asyncio.run(main())
    finally:
        parent.send(None)
        proc.join(join_s)
    assert proc.exitcode == 0
