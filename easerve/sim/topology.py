"""The deployment the simulator runs, as the stages' own frozen configs, and the live policy
objects built from them exactly as the services build theirs (easerve/stages/encode/app.py,
easerve/stages/encode/colocate.py, easerve/stages/prefill/stage.py, easerve/stages/decode/app.py)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from easerve.policy.batcher import BatcherConfig
from easerve.policy.partitioner import (
    TIMESLICE,
    Allocation,
    SMPartitioner,
)
from easerve.policy.partitioner import measure_grid
from easerve.policy.prefill_plan import PrefillBatchConfig
from easerve.policy.router import DeficitRouter
from easerve.engine.block_manager import BlockManager
from easerve.engine.config import DEFAULT_MAX_MODEL_LEN, GIB
from easerve.engine.scheduler import Scheduler
from easerve.stages.common.configs import (
    DecodeConfig,
    EncodeConfig,
    GatewayConfig,
    MonolithConfig,
    PrefillConfig,
)

DEFAULT_KV_BYTES_PER_TOKEN = 32 * 1024  # when the profile has no transfer section
DEFAULT_EMBED_BYTES_PER_TOKEN = 8 * 1024  # likewise: a 4096-wide bf16 embedding row (the encoder cache's charge)
DEFAULT_GPU_KV_GB = 40.0                # KV budget of a gpu_memory_utilization-sized decode (no device to ask)


@dataclass(frozen=True)
class Topology:
    """Instances per stage (a monolith is encode + co-located prefill + decode in one). `tp`: per
    stage, the GPUs each instance spans (cuda:N .. cuda:N+tp-1; default 1 each)."""
    gateway: GatewayConfig
    encode: tuple[EncodeConfig, ...] = ()
    prefill: tuple[PrefillConfig, ...] = ()
    decode: tuple[DecodeConfig, ...] = ()
    monolith: tuple[MonolithConfig, ...] = ()
    gpu_kv_gb: float = DEFAULT_GPU_KV_GB
    tp: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.monolith and (not self.prefill or not self.decode):
            raise ValueError("a topology needs at least one prefill and one decode instance, or a monolith")
        if not self.gpu_kv_gb > 0:
            raise ValueError(f"gpu_kv_gb must be > 0, got {self.gpu_kv_gb}")
        for stage, tps in self.tp.items():
            n = len(getattr(self, stage, ())) if stage in ("encode", "prefill", "decode", "monolith") else -1
            if n != len(tps) or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tps):
                raise ValueError(f"tp[{stage!r}] must list one int >= 1 per {stage} instance, got {tps!r}")

    def tp_of(self, stage: str, index: int) -> int:
        tps = self.tp.get(stage)
        return tps[index] if tps else 1

    @property
    def instances(self) -> int:
        return len(self.encode) + len(self.prefill) + len(self.decode) + len(self.monolith)


# ---- the live policies, from the configs -----------------------------------------------------------
def batcher_config(cfg: EncodeConfig) -> BatcherConfig:
    return cfg.batcher  # the encode service's own (easerve/stages/encode/app.py)


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
    config = dataclasses.replace(cfg.partitioner, policy=partition_policy(cfg))
    if config.policy != "dynamic":
        return SMPartitioner(None, config)
    shares = profile.encode.shares if profile.encode is not None else (1.0,)
    grid = measure_grid(lambda b, s: profile.encode_latency(b, s), cfg.batch_sizes, shares)
    return SMPartitioner(grid, config)


def no_partition() -> Allocation:
    return TIMESLICE


def scheduler(cfg: DecodeConfig | MonolithConfig, kv_bytes_per_token: int | None, gpu_kv_gb: float,
              tp: int = 1) -> Scheduler:
    """The engine's Scheduler over a BlockManager of the geometry the engine would pick (the
    stage config is the engine's config), with the model's length DEFAULT_MAX_MODEL_LEN and, for
    a GPU sized by --gpu-memory-utilization, the stated KV budget `gpu_kv_gb` (per GPU: an
    instance spanning tp GPUs holds tp x it)."""
    g = cfg.kv_geometry(kv_bytes_per_token or DEFAULT_KV_BYTES_PER_TOKEN, memory_bytes=int(gpu_kv_gb * tp * GIB),
                        model_len=DEFAULT_MAX_MODEL_LEN)
    blocks = BlockManager(g.num_blocks, g.block_size, g.max_seq_tokens)
    return Scheduler(blocks, cfg.max_running, cfg.max_waiting, compact=g.layout == "slots")
