"""The deployment the simulator runs, as the stages' own frozen configs, and the live policy
objects built from them exactly as the services build theirs (easerve/stages/encode/app.py,
easerve/stages/encode/colocate.py, easerve/stages/prefill/stage.py, easerve/stages/decode/app.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from easerve.policy.batcher import BatcherConfig
from easerve.policy.partitioner import (
    TIMESLICE,
    Allocation,
    PartitionerConfig,
    SMPartitioner,
)
from easerve.policy.partitioner import measure_grid
from easerve.policy.prefill_plan import PrefillBatchConfig
from easerve.policy.router import DeficitRouter
from easerve.engine.block_manager import BlockManager
from easerve.engine.config import DEFAULT_CPU_KV_BYTES, GIB, EngineConfig
from easerve.engine.scheduler import Scheduler
from easerve.stages.common.configs import (
    DEFAULT_MAX_MODEL_LEN,
    DecodeConfig,
    EncodeConfig,
    GatewayConfig,
    MonolithConfig,
    PrefillConfig,
)

DEFAULT_KV_BYTES_PER_TOKEN = 32 * 1024  # when the profile has no transfer section
DEFAULT_GPU_KV_GB = 40.0                # KV budget of a gpu_memory_utilization-sized decode (no device to ask)


@dataclass(frozen=True)
class Topology:
    """Instances per stage (a monolith is encode + co-located prefill + decode in one)."""
    gateway: GatewayConfig
    encode: tuple[EncodeConfig, ...] = ()
    prefill: tuple[PrefillConfig, ...] = ()
    decode: tuple[DecodeConfig, ...] = ()
    monolith: tuple[MonolithConfig, ...] = ()
    gpu_kv_gb: float = DEFAULT_GPU_KV_GB

    def __post_init__(self) -> None:
        if not self.monolith and (not self.prefill or not self.decode):
            raise ValueError("a topology needs at least one prefill and one decode instance, or a monolith")
        if not self.gpu_kv_gb > 0:
            raise ValueError(f"gpu_kv_gb must be > 0, got {self.gpu_kv_gb}")

    @property
    def instances(self) -> int:
        return len(self.encode) + len(self.prefill) + len(self.decode) + len(self.monolith)


# ---- the live policies, from the configs -----------------------------------------------------------
def batcher_config(cfg: EncodeConfig) -> BatcherConfig:
    return BatcherConfig(max_batch=cfg.max_batch, mode=cfg.batch_mode, safety_cap_s=cfg.safety_cap_s,
                         gap_coef=cfg.gap_coef, max_gap_s=min(cfg.max_gap_s, cfg.safety_cap_s))


def router(cfg: EncodeConfig) -> DeficitRouter:
    return DeficitRouter(cfg.remote_fraction)


def prefill_batch_config(cfg: PrefillConfig | EncodeConfig) -> PrefillBatchConfig:
    return PrefillBatchConfig(max_batched_tokens=cfg.max_batched_tokens, max_batch_size=cfg.max_prefill_batch)


def partition_policy(cfg: EncodeConfig) -> str:
    """The partition policy a co-located encode runs: the backend flag can force the baselines."""
    if cfg.sm_backend == "timeslice":
        return "timeslice"
    if cfg.sm_backend == "static":
        return "static"
    return cfg.partition_policy


def partitioner(cfg: EncodeConfig, profile: Any):
    """SMPartitioner of a co-located encode, its latency grid read from the profile
    (what the service measures at start-up); None without co-located prefill."""
    if not cfg.colocate_prefill:
        return None
    config = PartitionerConfig(policy=partition_policy(cfg), tolerance=cfg.partition_tolerance)
    if config.policy != "dynamic":
        return SMPartitioner(None, config)
    shares = profile.encode.shares if profile.encode is not None else (1.0,)
    grid = measure_grid(lambda b, s: profile.encode_latency(b, s), cfg.batch_sizes, shares)
    return SMPartitioner(grid, config)


def no_partition() -> Allocation:
    return TIMESLICE


def engine_config(cfg: DecodeConfig | MonolithConfig, gpu_kv_gb: float) -> EngineConfig:
    """As easerve/stages/decode/app.py's engine_config, with the model's length 4096 and, for a
    GPU sized by --gpu-memory-utilization, a stated KV budget."""
    common = dict(max_running=cfg.max_running, max_waiting=cfg.max_waiting,
                  max_seq_len=cfg.max_seq_len or DEFAULT_MAX_MODEL_LEN, block_size=cfg.block_size,
                  device=cfg.torch_device)
    if cfg.kv_capacity_tokens:
        return EngineConfig(kv_capacity_tokens=cfg.kv_capacity_tokens, **common)
    if cfg.num_slots:
        return EngineConfig(num_slots=cfg.num_slots, **common)
    if cfg.kv_cache_memory_gb:
        return EngineConfig(kv_cache_memory_bytes=int(cfg.kv_cache_memory_gb * GIB), **common)
    if cfg.torch_device.startswith("cpu"):
        return EngineConfig(kv_cache_memory_bytes=DEFAULT_CPU_KV_BYTES, **common)
    return EngineConfig(kv_cache_memory_bytes=int(gpu_kv_gb * GIB), **common)


def scheduler(cfg: DecodeConfig | MonolithConfig, kv_bytes_per_token: int | None, gpu_kv_gb: float) -> Scheduler:
    """The engine's Scheduler over a BlockManager of the geometry the engine would pick."""
    ec = engine_config(cfg, gpu_kv_gb)
    g = ec.kv_geometry(kv_bytes_per_token or DEFAULT_KV_BYTES_PER_TOKEN)
    blocks = BlockManager(g.num_blocks, g.block_size, g.max_seq_tokens)
    return Scheduler(blocks, ec.max_running, ec.max_waiting, compact=g.layout == "slots")
