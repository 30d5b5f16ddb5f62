"""The prefill process: its parts built from its config, and `main(cfg)` that serves them.

Entry point: python -m services.prefill --model DIR --decode H:P[,H:P] [--listen 127.0.0.1:50053]"""
from __future__ import annotations

import asyncio
from dataclasses import replace

from easerve.models.loader import load_adapter
from easerve.policy.clock import MonotonicClock
from easerve.rpc.server import ServerOptions, serve
from easerve.stages.common import load as stage_load
from easerve.stages.common.cli import dtype_of, write_port_file
from easerve.stages.common.configs import PrefillConfig
from easerve.stages.common.metrics import PrefillMetrics, new_registry
from easerve.stages.common.metrics_http import start_metrics_server
from easerve.stages.prefill.stage import build_prefill_stage
from easerve.stages.common.warmup import prefill_once
from easerve.stages.common.rendezvous import rendezvous_listen
from easerve.transport.handoff import embedding_receiver
from easerve.transport.node import local_identity
from easerve.wire.v1 import prefill_pb2_grpc
from easerve.stages.prefill.servicer import PrefillServicer


async def main(cfg: PrefillConfig) -> None:
    adapter = load_adapter(cfg.model, role="prefill", device=cfg.torch_device, dtype=dtype_of(cfg.dtype))
    opts = ServerOptions.of(cfg)
    registry = new_registry()
    stage = None
    receiver = embedding_receiver(cfg.torch_device, rendezvous_listen(cfg))
    pairs = receiver.transports.get("nccl")  # encode instances form NCCL pair groups here
    node = replace(local_identity(cfg.torch_device), kv_rendezvous=pairs.address if pairs is not None else "")
    metrics = PrefillMetrics(registry, queued=lambda: stage.loop.queued if stage is not None else 0,
                             kv_held=lambda: stage.senders.held_bytes if stage is not None else 0,
                             embed_received=lambda: receiver.received_bytes)
    stage = build_prefill_stage(cfg, adapter, opts.channel_options(), node, on_busy=metrics.on_batch,
                                metrics=metrics, clock=MonotonicClock())

    async def load() -> stage_load.Load:
        return stage_load.Load(stage.limit.inflight, cfg.max_inflight, stage.loop.queued, pace=stage.loop.pace,
                               busy_s=metrics.busy_s, overdue=stage.loop.overdue)

    async def warmup() -> None:  # one real prefill before SERVING
        await asyncio.get_running_loop().run_in_executor(None, prefill_once, adapter)
        stage.start()

    runner = await start_metrics_server(cfg.metrics_listen, registry, {"/trace": stage.loop.spans.http})
    try:
        await serve([(prefill_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(stage, receiver)),
                     stage_load.adder(stage_load.StageServicer("prefill", node, load))], cfg.listen,
                    health_services=["easerve.v1.Prefill"], options=opts, warmup=warmup,
                    on_bound=lambda p: write_port_file(cfg.port_file, p))
    finally:
        await stage.stop()
        if pairs is not None:
            await pairs.close()
        if runner is not None:
            await runner.cleanup()

