"""python -m services.decode --model DIR [--listen 0.0.0.0:50054] [--num-slots 64 --max-seq-len 2048]"""
from __future__ import annotations

import sys

from easerve.engine.engine import DecodeEngine, EngineConfig
from easerve.models.registry import load_adapter
from easerve.rpc.server import ServerOptions, run, serve
from easerve.stages.cli import base_parser, default_max_len, dtype_of, setup_process, write_port_file
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
    p.add_argument("--num-slots", type=int, default=None, help="KV slots (CPU layout); default 64 on cpu")
    p.add_argument("--max-seq-len", type=int, default=None, help="tokens per slot / per request")
    p.add_argument("--kv-capacity-tokens", type=int, default=None, help="paged KV pool size (GPU layout)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--port-file", default=None)
    return p.parse_args(argv)


def engine_config(args, max_len: int) -> EngineConfig:
    seq = args.max_seq_len or max_len
    if args.kv_capacity_tokens is None and args.num_slots is None and not args.device.startswith("cpu"):
        return EngineConfig(args.max_running, args.max_waiting, kv_capacity_tokens=64 * seq,
                            max_seq_len=seq, block_size=args.block_size, device=args.device)
    if args.kv_capacity_tokens is not None:
        return EngineConfig(args.max_running, args.max_waiting, kv_capacity_tokens=args.kv_capacity_tokens,
                            max_seq_len=seq, block_size=args.block_size, device=args.device)
    return EngineConfig(args.max_running, args.max_waiting, num_slots=args.num_slots or args.max_running,
                        max_seq_len=seq, device=args.device)


async def main(args) -> None:
    adapter = load_adapter(args.model, role="decode", device=args.device, dtype=dtype_of(args.dtype))
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
