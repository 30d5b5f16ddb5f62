"""python -m services.monolith --model DIR [--listen 127.0.0.1:50052] [engine flags]

Encode (with its micro-batcher), prefill (batched) and decode (continuous batching) in one
process, on all the cores of --device: the aggregated baseline of the paper's comparisons,
and a candidate deployment for `hasctl tune`. One gRPC port serves the Encode, Prefill and
Decode services, so the gateway talks to it exactly as to separate stages; the KV never
leaves the process. (It composes the other stages' packages: encode's `Encoder`, decode's `build_engine`.)
"""
from __future__ import annotations

import asyncio

from easerve.stages.common.metrics import DecodeMetrics
from easerve.rpc.server import HealthState, serve
from easerve.stages.common import load as stage_load
from easerve.stages.common.cli import write_port_file
from easerve.stages.common.configs import MonolithConfig
from easerve.stages.common.warmup import dummy_payload
from easerve.transport.handoff import KVReceiver, embedding_receiver
from easerve.wire.v1 import decode_pb2_grpc, prefill_pb2_grpc
from easerve.stages.decode.app import build_engine
from easerve.stages.decode.servicer import DRAIN_ALLOWS, DecodeServicer
from easerve.stages.encode.app import Encoder
from easerve.stages.prefill.servicer import PrefillServicer


# while draining: a request whose reservation this process holds still gets encoded and prefilled here
MONOLITH_DRAIN_ALLOWS = ("/easerve.v1.Encode/", "/easerve.v1.Prefill/", *DRAIN_ALLOWS)


async def main(cfg: MonolithConfig) -> None:
    enc = Encoder(cfg)
    health, stats = HealthState(), {}
    dmetrics = DecodeMetrics(enc.metrics.registry, lambda: stats.get("s"))
    engine = build_engine(cfg, enc.local_lm, health, dmetrics)
    enc.local.decode_in_process(engine.submit)
    enc.call_spans.append(engine.spans)  # GET /trace's "calls": its decode steps too

    async def load() -> stage_load.Load:
        s = stats["s"] = await engine.stats()
        return stage_load.Load(enc.servicer.limit.inflight + engine.num_streams, cfg.max_inflight,
                               enc.loop.queued + s.waiting, s.kv_free_tokens, s.kv_capacity_tokens,
                               overdue=enc.loop.overdue)

    async def warmup() -> None:
        engine.start()
        await enc.warmup()
        payload = await asyncio.get_running_loop().run_in_executor(None, dummy_payload, enc.local_lm)
        async for _ in engine.generate(payload):
            pass

    def refresh() -> None:
        enc.metrics.refresh()
        dmetrics.refresh()

    from easerve.stages.common.metrics_http import start_metrics_server
    runner = await start_metrics_server(cfg.metrics_listen, enc.metrics.registry,
                                        {"/trace": enc.trace, "/partition": enc.partition_info},
                                        before_scrape=refresh)
    adders = [enc.adders()[0], (prefill_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(enc.local, embedding_receiver(cfg.torch_device))),
              (decode_pb2_grpc.add_DecodeServicer_to_server,
               DecodeServicer(engine, KVReceiver(), cfg.max_waiting, dmetrics, cfg.stream_interval_ms)),
              stage_load.adder(stage_load.StageServicer("monolith", enc.node, load))]
    try:
        await serve(adders, cfg.listen, health_services=["easerve.v1.Encode", "easerve.v1.Prefill",
                                                          "easerve.v1.Decode"],
                    warmup=warmup, options=enc.opts, health_state=health,
                    on_bound=lambda p: write_port_file(cfg.port_file, p), drain_allows=MONOLITH_DRAIN_ALLOWS)
    finally:
        await enc.stop()
        await engine.stop()
        if runner is not None:
            await runner.cleanup()

