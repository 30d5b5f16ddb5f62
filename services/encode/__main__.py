"""python -m services.encode --model DIR (--prefill H:P | --colocate-prefill --decode H:P) [options]"""
from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import time

from easerve.control.batcher import AdaptiveBatcher, BatcherConfig
from easerve.control.router import DeficitRouter
from easerve.models.registry import load_adapter
from easerve.rpc.server import ServerOptions, run, serve
from easerve.stages.cli import addrs, base_parser, dtype_of, setup_process, write_port_file
from easerve.stages.kv_io import KVSender
from easerve.stages.metrics_http import start_metrics_server
from easerve.stages.prefill_stage import PrefillStage
from easerve.stages.transports import sender_for
from easerve.stages.warmup import prefill_once
from easerve.v1 import encode_pb2_grpc
from services.encode.batch_loop import EncodeLoop
from services.encode.colocate import build_controller, sample_items
from services.encode.metrics import EncodeMetrics
from services.encode.servicer import EncodeServicer


def parse(argv):
    p = base_parser("encode", "0.0.0.0:50052")
    p.add_argument("--prefill", default="", help="remote prefill workers, comma-separated host:port")
    p.add_argument("--colocate-prefill", action="store_true", help="run a prefill in this process and device")
    p.add_argument("--decode", default="", help="decode workers for the co-located prefill's KV")
    p.add_argument("--remote-fraction", type=float, default=1.0, help="s: share of requests sent to remote prefill")
    p.add_argument("--max-batch", type=int, default=8, help="B: most requests per encode batch")
    p.add_argument("--batch-mode", default="adaptive", choices=["adaptive", "fixed", "request_at_a_time"])
    p.add_argument("--safety-cap-s", type=float, default=1.0, help="longest a request waits for a batch")
    p.add_argument("--gap-coef", type=float, default=2.0, help="gap threshold = gap_coef / lambda")
    p.add_argument("--max-gap-s", type=float, default=0.05, help="ceiling of the gap threshold")
    p.add_argument("--sm-backend", default="auto",
                   choices=["auto", "green_contexts", "mps", "cpu_affinity", "timeslice", "static"])
    p.add_argument("--partition-policy", default="dynamic", choices=["dynamic", "static", "timeslice"])
    p.add_argument("--partition-profile", default=None, help="profile file: loaded if present, else written")
    p.add_argument("--profile-batch-sizes", default="1,2,4,8")
    p.add_argument("--partition-tolerance", type=float, default=0.1)
    p.add_argument("--kv-transport", default="auto", choices=["auto", "inline", "shm", "grpc", "cuda_ipc"])
    p.add_argument("--max-inflight", type=int, default=512, help="past this many requests: RESOURCE_EXHAUSTED")
    p.add_argument("--metrics-listen", default=None, help="host:port for GET /metrics, /trace, /partition")
    p.add_argument("--port-file", default=None)
    return p.parse_args(argv)


def _prefill_share(alloc) -> float:
    """What the co-located prefill runs with: its share, or the whole device when encode's
    allocation leaves it none (it then time-slices with encode, uncontrolled)."""
    return alloc.prefill_share if alloc is not None and alloc.prefill_share > 0 else 1.0


class Encoder:
    """The encode process's parts, built from flags."""

    def __init__(self, args):
        self.args = args
        self.opts = ServerOptions(grace_s=args.grace_s)
        self.adapter = load_adapter(args.model, role="encode", device=args.device, dtype=dtype_of(args.dtype))
        self.metrics = EncodeMetrics(args.remote_fraction)
        self.encode_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="encode")
        self.prefill_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="local-prefill")
        self.local_lm = None
        self.controller = self._controller()
        batcher = AdaptiveBatcher(BatcherConfig(
            max_batch=args.max_batch, mode=args.batch_mode, safety_cap_s=args.safety_cap_s,
            gap_coef=args.gap_coef, max_gap_s=min(args.max_gap_s, args.safety_cap_s)))
        self.loop = EncodeLoop(self.adapter, batcher, self.controller, self.metrics, self.encode_pool)
        self.servicer = EncodeServicer(self.loop, DeficitRouter(args.remote_fraction), self._local_stage(),
                                       addrs(args.prefill), self.opts.channel_options(), self.metrics,
                                       args.max_inflight)

    def _controller(self):
        if not self.args.colocate_prefill:
            return None  # encode alone on its device: nothing to share
        a = self.args
        sizes = tuple(int(x) for x in a.profile_batch_sizes.split(",") if x.strip())
        return build_controller(self.adapter, a.device, a.sm_backend, a.partition_policy, a.partition_profile,
                                sizes, a.partition_tolerance, self.encode_pool, self.prefill_pool)

    def _local_stage(self):
        a = self.args
        if not a.colocate_prefill:
            return None
        decode = addrs(a.decode)
        if not decode:
            raise ValueError("--colocate-prefill needs --decode addresses for its KV")
        lm = self.local_lm = load_adapter(a.model, role="prefill", device=a.device, dtype=dtype_of(a.dtype))
        sender = KVSender(sender_for(a.kv_transport, a.device, decode[0], self.opts))
        share = lambda: _prefill_share(self.controller.last)  # noqa: E731
        return PrefillStage(lm, decode, sender, self.opts.channel_options(), self.prefill_pool,
                            scope=self.controller.prefill_scope,
                            on_busy=lambda t0, t1: self.metrics.on_prefill(t0, t1, share()),
                            max_inflight=a.max_inflight)

    def partition_info(self, _req=None) -> dict:
        if self.controller is None:
            return {"backend": None, "reason": "no co-located prefill: encode has the device alone"}
        c = self.controller
        return {"backend": c.backend.name, "reason": c.backend.reason, "policy": c.partitioner.config.policy,
                "profile": c.partitioner.table.to_json(), "last": None if c.last is None else vars(c.last)}

    def trace(self, req) -> dict:
        window = float(req.query.get("window_s", "60"))
        now = time.monotonic()
        return {"now": now, "buckets": self.metrics.trace.buckets(now - window, now, max(window / 120, 0.05))}


async def main(args) -> None:
    enc = Encoder(args)
    runner = None
    if args.metrics_listen:
        runner = await start_metrics_server(args.metrics_listen, enc.metrics.registry,
                                            {"/trace": enc.trace, "/partition": enc.partition_info})

    async def warmup() -> None:
        loop = asyncio.get_running_loop()  # one real encode (and local prefill) before SERVING
        await loop.run_in_executor(enc.encode_pool, enc.adapter.encode, sample_items(enc.adapter, 1))
        if enc.local_lm is not None:
            await loop.run_in_executor(enc.prefill_pool, prefill_once, enc.local_lm)
        enc.loop.start()

    try:
        await serve([(encode_pb2_grpc.add_EncodeServicer_to_server, enc.servicer)], args.listen,
                    health_services=["easerve.v1.Encode"], warmup=warmup, options=enc.opts,
                    on_bound=lambda p: write_port_file(args.port_file, p))
    finally:
        await enc.loop.stop()
        if runner is not None:
            await runner.cleanup()


if __name__ == "__main__":
    a = parse(sys.argv[1:])
    setup_process(a)
    run(main(a))
