"""KV transport throughput between two processes vs a plain memory copy, same run.

    python bench/kv_transport.py [--layers 28 --tokens 1024 --repeats 7]

Payload: a bfloat16 KV cache of `layers` x (K, V) x [kv_heads, tokens, head_dim]
(default 28 x 2 x [4, 1024, 128] = 58.7 MB, a 7B-class model with 1k prompt tokens).
Each transport is timed from the sender's send() to the receiver process holding usable
tensors (recv() returned, handle shipped as a serialized KVTransfer over a pipe), median
of `repeats`. Baseline ("memcpy"): the faster of two plain copies of the same tensors in the
sender process, copy_ into memory already touched and torch clone into fresh memory.
  shm        receiver rebuilds tensors as views of the segment (the default)
  shm_copy   receiver copies out into private memory before returning
  grpc       chunked push over KVStream on 127.0.0.1, receiver parks and views it
Last stdout line: one JSON object, ratios first.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness.results import add_save_flag, finish  # noqa: E402

import torch  # noqa: E402

from easerve.wire import codec  # noqa: E402
from easerve.transport.base import handle_from_proto, handle_to_proto  # noqa: E402
from easerve.transport.grpc_stream import GrpcStreamConfig, GrpcStreamTransport, KVStreamServicer  # noqa: E402
from easerve.transport.shm import ShmConfig, ShmTransport  # noqa: E402
from easerve.types import KVPayload, SamplingParams  # noqa: E402
from easerve.wire.v1 import kv_pb2, kv_pb2_grpc  # noqa: E402

MAX_MSG = 64 << 20


def receiver(conn) -> None:
    """Child process: a KVStream server plus shm receivers; answers each handle when received."""
    import grpc

    async def main():
        servicer = KVStreamServicer(GrpcStreamConfig())
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MSG)])
        kv_pb2_grpc.add_KVStreamServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        rx = {"shm": ShmTransport(), "shm_copy": ShmTransport(ShmConfig(copy_out=True)),
              "grpc": GrpcStreamTransport(servicer=servicer)}
        conn.send(port)
        while (msg := await asyncio.to_thread(conn.recv)) is not None:
            mode, blob = msg
            header, tensors = await rx[mode].recv(handle_from_proto(kv_pb2.KVTransfer.FromString(blob)))
            conn.send(len(tensors))
            del header, tensors
        await server.stop(0)
    asyncio.run(main())


def make_kv(layers: int, tokens: int, heads: int, dim: int) -> KVPayload:
    mk = lambda: torch.randn(heads, tokens, dim).to(torch.bfloat16)  # noqa: E731
    return KVPayload("bench", [mk() for _ in range(layers)], [mk() for _ in range(layers)],
                     prompt_len=tokens, rope_delta=0, first_token=1, sampling=SamplingParams())


async def transfer(mode: str, tx, conn, header, tensors) -> float:
    t0 = time.perf_counter()
    h = await tx.send("bench", header, tensors)
    conn.send((mode, handle_to_proto(h).SerializeToString()))
    await asyncio.to_thread(conn.recv)
    dt = time.perf_counter() - t0
    tx.release(h)
    return dt


def copy_warm(tensors, dst) -> float:
    """One copy of the same bytes into memory already touched (pure copy bandwidth)."""
    t0 = time.perf_counter()
    for d, t in zip(dst, tensors):
        d.copy_(t)
    return time.perf_counter() - t0


def clone(tensors) -> float:
    """torch clone: a copy into fresh allocations (pays page faults when the allocator does)."""
    t0 = time.perf_counter()
    out = [t.clone() for t in tensors]
    dt = time.perf_counter() - t0
    del out
    return dt


async def bench(args, conn, port: int) -> dict:
    p = make_kv(args.layers, args.tokens, args.heads, args.dim)
    header, tensors = codec.kv_to_parts(p)
    nbytes = codec.frame_size(header)
    shm = ShmTransport()
    grpc_tx = GrpcStreamTransport(peer=f"127.0.0.1:{port}", config=GrpcStreamConfig(
        chunk_bytes=int(args.chunk_mb * (1 << 20))), channel_options=[("grpc.max_send_message_length", MAX_MSG)])
    dst = [torch.empty_like(t) for t in tensors]
    times: dict[str, list[float]] = {"copy_warm": [], "clone": [], "shm": [], "shm_copy": [], "grpc": []}
    for r in range(args.repeats + 1):  # the first round warms up and is dropped
        got = {"copy_warm": copy_warm(tensors, dst), "clone": clone(tensors),
               "shm": await transfer("shm", shm, conn, header, tensors),
               "shm_copy": await transfer("shm_copy", shm, conn, header, tensors),
               "grpc": await transfer("grpc", grpc_tx, conn, header, tensors)}
        if r:
            for k, v in got.items():
                times[k].append(v)
    await grpc_tx.close()
    await shm.close()
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    base = max(gbps["copy_warm"], gbps["clone"])  # the faster plain copy is the baseline
    for k, v in times.items():
        print(f"{k:9s} median {statistics.median(v) * 1e3:8.1f} ms  {gbps[k]:6.2f} GB/s  "
              f"(runs: {', '.join(f'{x * 1e3:.0f}' for x in v)} ms)")
    return {
        "shm_over_memcpy": round(gbps["shm"] / base, 3),
        "grpc_over_memcpy": round(gbps["grpc"] / base, 3),
        "shm_copy_over_memcpy": round(gbps["shm_copy"] / base, 3),
        "memcpy_gbps": round(base, 3), "copy_warm_gbps": round(gbps["copy_warm"], 3),
        "clone_gbps": round(gbps["clone"], 3),
        "shm_gbps": round(gbps["shm"], 3),
        "shm_copy_gbps": round(gbps["shm_copy"], 3), "grpc_gbps": round(gbps["grpc"], 3),
        "payload_mb": round(nbytes / 1e6, 1), "repeats": args.repeats,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--chunk-mb", type=float, default=4.0, help="gRPC chunk size")
    add_save_flag(ap)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child,), daemon=True)
    proc.start()
    try:
        port = parent.recv()
        result = asyncio.run(bench(args, parent, port))
    finally:
        parent.send(None)
        proc.join(30)
    finish("kv_transport", args, result)


if __name__ == "__main__":
    main()
