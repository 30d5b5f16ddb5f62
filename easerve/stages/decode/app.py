"""The decode process: its parts built from its config, and `main(cfg)` that serves them.

Entry point: python -m services.decode --model DIR [--listen 127.0.0.1:50054] [--num-slots 64 --max-seq-len 2048]"""
from __future__ import annotations


from easerve.engine.engine import DecodeEngine, EngineConfig
from easerve.stages.common.metrics import DecodeMetrics, new_registry
from easerve.models.registry import load_adapter
from easerve.rpc.server import HealthState, ServerOptions, serve
from easerve.stages.common import load as stage_load
from easerve.stages.decode.async_engine import AsyncEngine
from easerve.stages.common.cli import default_max_len, dtype_of, write_port_file
from easerve.stages.common.configs import DecodeConfig
from easerve.stages.common.metrics_http import start_metrics_server
from easerve.stages.common.warmup import dummy_payload
from easerve.transport.handoff import receivers
from easerve.transport.node import local_identity
from easerve.wire.v1 import decode_pb2_grpc
from easerve.stages.decode.servicer import DecodeServicer


def engine_config(cfg, max_len: int) -> EngineConfig:
    """KV sized by --kv-capacity-tokens or --num-slots when given, else from memory
    (--kv-cache-memory-gb; on a GPU --gpu-memory-utilization): the layout is the engine's
    choice (slots read in place; paged where flashinfer runs)."""
    from easerve.engine.config import GIB, default_cpu_kv_bytes
    common = dict(max_running=cfg.max_running, max_waiting=cfg.max_waiting, max_seq_len=cfg.max_seq_len or max_len,
                  block_size=cfg.block_size, device=cfg.torch_device)
    if cfg.kv_capacity_tokens:
        return EngineConfig(kv_capacity_tokens=cfg.kv_capacity_tokens, **common)
    if cfg.num_slots:
        return EngineConfig(num_slots=cfg.num_slots, **common)
    if cfg.kv_cache_memory_gb:
        return EngineConfig(kv_cache_memory_bytes=int(cfg.kv_cache_memory_gb * GIB), **common)
    if cfg.torch_device.startswith("cpu"):
        return EngineConfig(kv_cache_memory_bytes=default_cpu_kv_bytes(), **common)
    return EngineConfig(gpu_memory_utilization=cfg.gpu_memory_utilization, **common)


def build_engine(cfg, adapter, health: HealthState, metrics: DecodeMetrics | None = None) -> AsyncEngine:
    engine = DecodeEngine(adapter, engine_config(cfg, default_max_len(adapter.text_config)))
    return AsyncEngine(engine, on_fatal=lambda e: health.fail(f"decode engine failed: {e!r}"),
                       on_step=metrics.on_step if metrics is not None else None)


async def main(cfg: DecodeConfig) -> None:
    adapter = load_adapter(cfg.model, role="decode", device=cfg.torch_device, dtype=dtype_of(cfg.dtype))
    health, registry = HealthState(), new_registry()
    last_stats = {}
    metrics = DecodeMetrics(registry, lambda: last_stats.get("s"))
    engine = build_engine(cfg, adapter, health, metrics)
    opts = ServerOptions.of(cfg)
    kv_in, extra = receivers(cfg.torch_device)
    servicer = DecodeServicer(engine, kv_in, cfg.max_waiting, metrics)
    node = local_identity(cfg.torch_device)

    async def load() -> stage_load.Load:
        s = last_stats["s"] = await engine.stats()
        return stage_load.Load(engine.num_streams, cfg.max_running + cfg.max_waiting, s.waiting,
                               s.kv_free_tokens, s.kv_capacity_tokens)

    async def warmup() -> None:
        engine.start()
        async for _ in engine.generate(dummy_payload(adapter)):  # one real decode before SERVING
            pass
        last_stats["s"] = await engine.stats()

    runner = await start_metrics_server(cfg.metrics_listen, registry, before_scrape=metrics.refresh)
    try:
        await serve([(decode_pb2_grpc.add_DecodeServicer_to_server, servicer), *extra,
                     stage_load.adder(stage_load.StageServicer("decode", node, load))], cfg.listen,
                    health_services=["easerve.v1.Decode"], warmup=warmup, options=opts, health_state=health,
                    on_bound=lambda p: write_port_file(cfg.port_file, p), settle=servicer.settle)
    finally:
        await engine.stop()
        if runner is not None:
            await runner.cleanup()

