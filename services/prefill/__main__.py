"""python -m services.prefill --model DIR --decode H:P [--listen 0.0.0.0:50053]"""
from __future__ import annotations

import asyncio
import sys

from easerve.models.registry import load_adapter
from easerve.rpc.server import ServerOptions, run, serve
from easerve.stages.cli import addrs, base_parser, dtype_of, setup_process, write_port_file
from easerve.stages.kv_io import KVSender
from easerve.stages.prefill_stage import PrefillStage
from easerve.stages.transports import sender_for
from easerve.stages.warmup import prefill_once
from easerve.v1 import prefill_pb2_grpc
from services.prefill.servicer import PrefillServicer


def parse(argv):
    p = base_parser("prefill", "0.0.0.0:50053")
    p.add_argument("--decode", required=True, help="decode workers, comma-separated host:port")
    p.add_argument("--kv-transport", default="auto", choices=["auto", "inline", "shm", "grpc", "cuda_ipc", "nccl"])
    p.add_argument("--max-inflight", type=int, default=512, help="past this many requests: RESOURCE_EXHAUSTED")
    p.add_argument("--port-file", default=None)
    return p.parse_args(argv)


async def main(args) -> None:
    adapter = load_adapter(args.model, role="prefill", device=args.device, dtype=dtype_of(args.dtype))
    opts = ServerOptions(grace_s=args.grace_s)
    decode = addrs(args.decode)
    sender = KVSender(sender_for(args.kv_transport, args.device, decode[0], opts))
    stage = PrefillStage(adapter, decode, sender, opts.channel_options(), max_inflight=args.max_inflight)
    async def warmup() -> None:  # one real prefill before SERVING
        await asyncio.get_running_loop().run_in_executor(None, prefill_once, adapter)

    await serve([(prefill_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(stage))], args.listen,
                health_services=["easerve.v1.Prefill"], options=opts, warmup=warmup,
                on_bound=lambda p: write_port_file(args.port_file, p))


if __name__ == "__main__":
    a = parse(sys.argv[1:])
    setup_process(a)
    run(main(a))
