"""The decode process: its parts built from its config, and `main(cfg)` that serves them.

Entry point: python -m services.decode --model DIR [--listen 127.0.0.1:50054] [--num-slots 64 --max-seq-len 2048]"""
from __future__ import annotations

from dataclasses import replace


from easerve.engine.engine import DecodeEngine
from easerve.stages.common.metrics import DecodeMetrics, new_registry
from easerve.engine.config import EngineConfig
from easerve.models.loader import load_adapter
from easerve.rpc.server import HealthState, ServerOptions, serve
from easerve.stages.common import load as stage_load
from easerve.stages.decode.async_engine import AsyncEngine
from easerve.stages.common.cli import dtype_of, write_port_file
from easerve.stages.common.configs import DecodeConfig
from easerve.stages.common.metrics_http import start_metrics_server
from easerve.stages.common.rendezvous import rendezvous_listen
from easerve.stages.common.warmup import dummy_payload
from easerve.transport.handoff import receivers
from easerve.transport.node import local_identity
from easerve.wire.v1 import decode_pb2_grpc
from easerve.stages.decode.servicer import DRAIN_ALLOWS, DecodeServicer


def build_engine(cfg: EngineConfig, adapter, health: HealthState, metrics: DecodeMetrics | None = None) -> AsyncEngine:
    """The engine of a decode (or monolith) config: its engine flags are EngineConfig's fields, so
    the config is the engine's as it is (KV sized as EngineConfig.sizing says)."""
    engine = DecodeEngine(adapter, cfg)
    return AsyncEngine(engine, on_fatal=lambda e: health.fail(f"decode engine failed: {e!r}"),
                       on_step=metrics.on_step if metrics is not None else None)


async def main(cfg: DecodeConfig) -> None:
    adapter = load_adapter(cfg.model, role="decode", device=cfg.torch_device, dtype=dtype_of(cfg.dtype))
    health, registry = HealthState(), new_registry()
    last_stats = {}
    metrics = DecodeMetrics(registry, lambda: last_stats.get("s"))
    engine = build_engine(cfg, adapter, health, metrics)
    opts = ServerOptions.of(cfg)
    kv_in, extra = receivers(cfg.torch_device, rendezvous_listen(cfg))
    servicer = DecodeServicer(engine, kv_in, cfg.max_waiting, metrics, cfg.stream_interval_ms)
    pairs = kv_in.transports.get("nccl")
    node = replace(local_identity(cfg.torch_device), kv_rendezvous=pairs.address if pairs is not None else "")

    async def load() -> stage_load.Load:
        s = last_stats["s"] = await engine.stats()
        return stage_load.Load(engine.num_streams, cfg.max_running + cfg.max_waiting, s.waiting,
                               s.kv_free_tokens, s.kv_capacity_tokens, pace=engine.pace)

    async def warmup() -> None:
        engine.start()
        async for _ in engine.generate(dummy_payload(adapter)):  # one real decode before SERVING
            pass
        last_stats["s"] = await engine.stats()

    runner = await start_metrics_server(cfg.metrics_listen, registry, {"/trace": engine.spans.http},
                                        before_scrape=metrics.refresh)
    try:
        await serve([(decode_pb2_grpc.add_DecodeServicer_to_server, servicer), *extra,
                     stage_load.adder(stage_load.StageServicer("decode", node, load))], cfg.listen,
                    health_services=["easerve.v1.Decode"], warmup=warmup, options=opts, health_state=health,
                    on_bound=lambda p: write_port_file(cfg.port_file, p), drain_allows=DRAIN_ALLOWS)
    finally:
        await engine.stop()
        if pairs is not None:
            await pairs.close()
        if runner is not None:
            await runner.cleanup()

