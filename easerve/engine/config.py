"""EngineConfig: the decode engine's limits and KV geometry; its fields are the decode flags.

DecodeConfig and MonolithConfig (easerve.stages.common.configs) inherit these fields, so the
flags `--max-running`, `--kv-cache-memory-gb`, ... are this class's fields and a stage config
is handed to the engine as it is. 0 leaves a size unset. What sizes the KV pool (`sizing`),
the first that is set:
- `kv_capacity_tokens`: paged, that many tokens in blocks of `block_size`;
- `num_slots`: slots, one of max_seq_len tokens per running request;
- `kv_cache_memory_gb`: as many tokens as fit in that many GiB (vLLM's CPU
  `--kv-cache-memory-gb` / VLLM_CPU_KVCACHE_SPACE);
- nothing, on a CPU device: DEFAULT_CPU_KV_BYTES, at most a quarter of RAM;
- nothing, on cuda: `gpu_memory_utilization`, a fraction of the device's total memory, less
  what this process already holds (the weights), as vLLM's `--gpu-memory-utilization`.
`max_seq_len` 0 is the model's context capped at DEFAULT_MAX_MODEL_LEN (`default_max_len`).
Memory-sized pools never hold more than `max_running` requests of `max_seq_len` tokens would
use. `kv_layout` "auto" picks slots (attention reads the pool in place) unless the engine's
device runs flashinfer's paged kernel (see `attention.select_attention`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from easerve.fields import Device, FieldError, NonNegFloat, NonNegInt, PosInt, Share, check_fields, opt, torch_device

DEFAULT_KV_TOKENS = 16384   # the in-process pipeline's paged pool (easerve.pipeline)
DEFAULT_MAX_MODEL_LEN = 4096  # default per-request token limit (prompt + max_tokens) of a deployment
GIB = 1 << 30
DEFAULT_CPU_KV_BYTES = 2 * GIB
Sizing = Literal["kv_capacity_tokens", "num_slots", "kv_cache_memory_gb", "cpu_default", "gpu_memory_utilization"]
DEVICE_HELP = "cpu, cpu:0-3 (pinned to those cores), cuda or cuda:N"


def default_max_len(text_config) -> int:
    """The model's context length, capped at DEFAULT_MAX_MODEL_LEN (gateway and decode agree)."""
    return min(int(getattr(text_config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN)), DEFAULT_MAX_MODEL_LEN)


@dataclass(frozen=True)
class KVGeometry:
    layout: Literal["paged", "slots"]
    num_blocks: int
    block_size: int
    max_seq_tokens: int | None   # the most tokens one request may reserve (None: the pool)


@dataclass(frozen=True)
class EngineConfig:
    max_running: PosInt = opt(64, "requests decoded together per step")
    max_waiting: NonNegInt = opt(256, "admission queue; past it RESOURCE_EXHAUSTED")
    kv_cache_memory_gb: NonNegFloat = opt(0.0, "KV pool size in GiB (0: on cpu 2 GiB, at most a quarter of RAM); "
                                               "never more than --max-running requests of --max-seq-len need")
    gpu_memory_utilization: Share = opt(0.9, "on cuda, without --kv-cache-memory-gb: the fraction of the "
                                             "device's memory this process may use (weights + KV), as vLLM's")
    num_slots: NonNegInt = opt(0, "fixed KV slots of --max-seq-len instead of sizing from memory (0: from memory)")
    max_seq_len: NonNegInt = opt(0, "tokens per request (0 = the model's context, capped at 4096)")
    kv_capacity_tokens: NonNegInt = opt(0, "fixed paged KV pool size in tokens instead of memory (0: from memory)")
    block_size: PosInt = opt(16, "tokens per KV block (paged layout)")
    device: Device = opt("cpu", DEVICE_HELP, wired=True)
    # not flags: the engine's own choices, for tests and benchmarks
    kv_layout: Literal["auto", "paged", "slots"] = "auto"
    # CPU: per linear shape, keep nn.Linear's weight layout or store it transposed, whichever
    # measures faster at one row (easerve.engine.cpu_gemv); "torch" keeps every layer as loaded
    linear_layout: Literal["auto", "torch"] = "auto"

    def __post_init__(self) -> None:
        check_fields(self)
        self._check_engine()

    def _check_engine(self) -> None:
        if self.max_seq_len == 1:
            raise FieldError("--max-seq-len", "must be 0 (the model's context) or >= 2, got 1")
        if 0 < self.kv_capacity_tokens < self.block_size:
            raise FieldError("--kv-capacity-tokens", f"({self.kv_capacity_tokens}) must hold at least one block "
                                                     f"of --block-size {self.block_size}")
        if (self.sizing == "num_slots" and self.kv_layout == "paged") or \
                (self.sizing == "kv_capacity_tokens" and self.kv_layout == "slots"):
            raise ValueError(f"kv_layout={self.kv_layout!r} contradicts --{self.sizing.replace('_', '-')}; "
                             "drop one of them")

    @property
    def sizing(self) -> Sizing:
        """What sizes the KV pool: the first of kv_capacity_tokens, num_slots, kv_cache_memory_gb
        that is set, else the device's default (see the module's docstring)."""
        for name in ("kv_capacity_tokens", "num_slots", "kv_cache_memory_gb"):
            if getattr(self, name):
                return name
        return "cpu_default" if self.torch_device == "cpu" else "gpu_memory_utilization"

    @property
    def torch_device(self) -> str:
        return torch_device(self.device)

    @property
    def memory_sized(self) -> bool:
        return self.sizing in ("kv_cache_memory_gb", "cpu_default", "gpu_memory_utilization")

    def geometry(self) -> tuple[int, int, int | None]:
        """(num_blocks, block_size, max tokens per request) of a token-sized config."""
        if self.memory_sized:
            raise ValueError("a memory-sized config has no fixed geometry; use kv_geometry(bytes_per_token, ...)")
        g = self.kv_geometry(0)
        return g.num_blocks, g.block_size, g.max_seq_tokens

    def kv_geometry(self, bytes_per_token: int, memory_bytes: int | None = None,
                    paged_kernel: bool = False, model_len: int | None = None) -> KVGeometry:
        """Resolve the pool's geometry. `memory_bytes`: the KV budget of a gpu_memory_utilization
        config (see `gpu_kv_budget`); `paged_kernel`: the device runs a paged attention
        kernel in place (then "auto" picks paged); `model_len`: what max_seq_len 0 stands for
        (`default_max_len` of the model; None: no limit but the pool's)."""
        seq = self.max_seq_len or model_len
        if self.sizing == "num_slots":
            if not seq or seq < 2:
                raise ValueError("slot KV (--num-slots) needs --max-seq-len >= 2")
            return KVGeometry("slots", self.num_slots, seq, seq)
        if self.sizing == "kv_capacity_tokens":
            return KVGeometry("paged", max(1, self.kv_capacity_tokens // self.block_size), self.block_size, seq)
        budget = self.kv_memory_bytes(memory_bytes)
        if bytes_per_token <= 0:
            raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
        tokens = budget // bytes_per_token
        want = seq or self.block_size
        if tokens < want:
            raise ValueError(
                f"KV memory {budget / GIB:.2f} GiB holds only {tokens} tokens ({bytes_per_token} bytes each), "
                f"less than one request of max_seq_len {want}; raise --kv-cache-memory-gb "
                "or --gpu-memory-utilization, or lower --max-seq-len")
        layout = self.kv_layout if self.kv_layout != "auto" else "paged" if not seq or paged_kernel else "slots"
        if layout == "slots":
            return KVGeometry("slots", min(tokens // want, self.max_running), want, want)
        blocks = tokens // self.block_size
        if seq:
            blocks = min(blocks, self.max_running * -(-seq // self.block_size))
        return KVGeometry("paged", blocks, self.block_size, seq)

    def kv_memory_bytes(self, memory_bytes: int | None = None) -> int:
        """The KV budget of a memory-sized config; `memory_bytes`: the device's, for
        gpu_memory_utilization (see `gpu_kv_budget`)."""
        if self.sizing == "kv_cache_memory_gb":
            return int(self.kv_cache_memory_gb * GIB)
        if self.sizing == "cpu_default":
            return default_cpu_kv_bytes()
        if memory_bytes is None:
            raise ValueError("gpu_memory_utilization needs the device's KV budget (memory_bytes)")
        return memory_bytes


def gpu_kv_budget(total_bytes: int, free_bytes: int, used_bytes: int, utilization: float) -> int:
    """KV bytes for gpu_memory_utilization: utilization x the device's total memory, less what
    this process already holds (weights, `used_bytes`), capped at what is free now (other
    stages of the GPU hold the rest). Raises ValueError saying what to change when nothing is
    left; a budget too small for one request is refused later, by `kv_geometry`."""
    wanted = int(total_bytes * utilization) - used_bytes
    if wanted <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} of {total_bytes / GIB:.1f} GiB leaves nothing for KV "
                         f"after the {used_bytes / GIB:.1f} GiB this process holds; raise --gpu-memory-utilization")
    budget = min(wanted, free_bytes)
    if budget <= 0:
        raise ValueError(f"no device memory is free for KV ({total_bytes / GIB:.1f} GiB, all held); "
                         "free memory on the GPU or move a stage to another one")
    return budget


def default_cpu_kv_bytes() -> int:
    """CPU KV budget when none is given: DEFAULT_CPU_KV_BYTES, at most a quarter of RAM."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf on this platform
        return DEFAULT_CPU_KV_BYTES
    return min(DEFAULT_CPU_KV_BYTES, ram // 4)
