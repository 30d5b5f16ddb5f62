"""python -m services.decode --model DIR [--listen 0.0.0.0:50054] [--num-slots 64 --max-seq-len 2048]"""
from __future__ import annotations

import sys

from easerve.engine.engine import DecodeEngine, EngineConfig
from easerve.models.registry import load_adapter
from easerve.rpc.server import ServerOptions, run, serve
from easerve.stages.cli import base_parser, default_max_len, setup_process, write_port_file
from easerve.stages.engine_loop import AsyncEngine
from easerve.stages.kv_io import KVReceiver
from easerve.stages.transports import receivers
from easerve.stages.warmup import dummy_payload
from easerve.v1 import decode_pb2_grpc
from services.decode.servicer import DecodeServicer


def parse(argv):
    p = base_parser("decode", "0.0.0.0:50054")
    p.add_argument("--max-running", type=int, default=64, help="requests decoded together per step")
    p.add_argument("--max-waiting", type=int, default=256, help="admission queue; past it RESOURCE_EXHAUSTED")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV pool size in GiB (default on cpu: 2 GiB, at most a quarter of RAM); "
                        "never more than --max-running requests of --max-seq-len need")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on cuda, without --kv-cache-memory-gb: the fraction of the device's memory this "
                        "process may use (weights + KV), as vLLM's")
    p.add_argument("--num-slots", type=int, default=None, help="fixed KV slots of --max-seq-len (instead of memory)")
    p.add_argument("--max-seq-len", type=int, default=None, help="tokens per request (default: the model's context)")
    p.add_argument("--kv-capacity-tokens", type=int, default=None, help="fixed paged KV pool size (instead of memory)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (paged layout)")
    p.add_argument("--port-file", default=None)
    return p.parse_args(argv)


def engine_config(args, max_len: int) -> EngineConfig:
    """KV sized by --kv-capacity-tokens or --num-slots when given, else from memory: the layout
    is the engine's choice (slots read in place; paged where flashinfer runs)."""
    from easerve.engine.config import GIB, default_cpu_kv_bytes
    common = dict(max_running=args.max_running, max_waiting=args.max_waiting, max_seq_len=args.max_seq_len or max_len,
                  block_size=args.block_size, device=args.device)
    if args.kv_capacity_tokens is not None:
        return EngineConfig(kv_capacity_tokens=args.kv_capacity_tokens, **common)
    if args.num_slots is not None:
        return EngineConfig(num_slots=args.num_slots, **common)
    if args.kv_cache_memory_gb is not None:
        return EngineConfig(kv_cache_memory_bytes=int(args.kv_cache_memory_gb * GIB), **common)
    if args.device.startswith("cpu"):
        return EngineConfig(kv_cache_memory_bytes=default_cpu_kv_bytes(), **common)
    return EngineConfig(gpu_memory_utilization=args.gpu_memory_utilization, **common)


async def main(args) -> None:
    adapter = load_adapter(args.model, role="decode", device=args.device)
    engine = AsyncEngine(DecodeEngine(adapter, engine_config(args, default_max_len(adapter.text_config))))
    opts = ServerOptions(grace_s=args.grace_s)
    kv_in, extra = receivers(args.device, opts)
    servicer = DecodeServicer(engine, KVReceiver(kv_in), args.max_waiting)

    async def warmup() -> None:
        engine.start()
        async for _ in engine.generate(dummy_payload(adapter)):  # one real decode before SERVING
            pass

    try:
        await serve([(decode_pb2_grpc.add_DecodeServicer_to_server, servicer), *extra], args.listen,
                    health_services=["easerve.v1.Decode"], warmup=warmup, options=opts,
                    on_bound=lambda p: write_port_file(args.port_file, p))
    finally:
        await engine.stop()


if __name__ == "__main__":
    a = parse(sys.argv[1:])
    setup_process(a)
    run(main(a))
