"""EngineConfig: the decode engine's limits and KV geometry, sized in tokens or from memory.

Four ways to size the KV pool (set at most one):
- `kv_capacity_tokens`: paged, that many tokens in blocks of `block_size`;
- `num_slots` (with `max_seq_len`): slots, one of max_seq_len tokens per running request;
- `kv_cache_memory_bytes`: as many tokens as fit in that many bytes (vLLM's CPU
  `--kv-cache-memory-gb` / VLLM_CPU_KVCACHE_SPACE);
- `gpu_memory_utilization`: a fraction of the device's total memory, less what this process
  already holds (the weights), as vLLM's `--gpu-memory-utilization`.
None: paged with DEFAULT_KV_TOKENS. Memory-sized pools never hold more than `max_running`
requests of `max_seq_len` tokens would use. `kv_layout` "auto" picks slots (attention reads
the pool in place; needs max_seq_len) unless the engine's device runs flashinfer's paged
kernel (see `attention.select_attention`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

DEFAULT_KV_TOKENS = 16384   # paged pool size when nothing sizes it
GIB = 1 << 30
DEFAULT_CPU_KV_BYTES = 2 * GIB


@dataclass(frozen=True)
class KVGeometry:
    layout: Literal["paged", "slots"]
    num_blocks: int
    block_size: int
    max_seq_tokens: int | None   # the most tokens one request may reserve (None: the pool)


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 64
    max_waiting: int = 256
    kv_capacity_tokens: int | None = None
    num_slots: int | None = None
    max_seq_len: int | None = None
    block_size: int = 16
    device: str = "cpu"
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    kv_layout: Literal["auto", "paged", "slots"] = "auto"
    # CPU: per linear shape, keep nn.Linear's weight layout or store it transposed, whichever
    # measures faster at one row (easerve.engine.cpu_gemv); "torch" keeps every layer as loaded
    linear_layout: Literal["auto", "torch"] = "auto"

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        sizing = [n for n in ("kv_capacity_tokens", "num_slots", "kv_cache_memory_bytes", "gpu_memory_utilization")
                  if getattr(self, n) is not None]
        if len(sizing) > 1:
            raise ValueError(f"set only one of kv_capacity_tokens (paged KV), num_slots with max_seq_len (slots), "
                             f"kv_cache_memory_bytes or gpu_memory_utilization; got {', '.join(sizing)}")
        if self.kv_layout not in ("auto", "paged", "slots"):
            raise ValueError(f"kv_layout must be 'auto', 'paged' or 'slots', got {self.kv_layout!r}")
        if self.linear_layout not in ("auto", "torch"):
            raise ValueError(f"linear_layout must be 'auto' or 'torch', got {self.linear_layout!r}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.num_slots is not None and (self.num_slots < 1 or not self.max_seq_len):
            raise ValueError(f"slot KV needs num_slots >= 1 and max_seq_len >= 2, got {self.num_slots}, {self.max_seq_len}")
        if (self.num_slots is not None and self.kv_layout == "paged") or \
                (self.kv_capacity_tokens is not None and self.kv_layout == "slots"):
            raise ValueError(f"kv_layout={self.kv_layout!r} contradicts {sizing[0]}; drop one of them")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.block_size:
            raise ValueError(f"kv_capacity_tokens ({self.kv_capacity_tokens}) must hold at least one block "
                             f"of block_size={self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
            if not self.device.startswith("cuda"):
                raise ValueError(f"gpu_memory_utilization needs a cuda device, got {self.device!r}; "
                                 "size CPU KV with kv_cache_memory_bytes")

    @property
    def memory_sized(self) -> bool:
        return self.kv_cache_memory_bytes is not None or self.gpu_memory_utilization is not None

    def geometry(self) -> tuple[int, int, int | None]:
        """(num_blocks, block_size, max tokens per request) of a token-sized config."""
        if self.memory_sized:
            raise ValueError("a memory-sized config has no fixed geometry; use kv_geometry(bytes_per_token, ...)")
        g = self.kv_geometry(0)
        return g.num_blocks, g.block_size, g.max_seq_tokens

    def kv_geometry(self, bytes_per_token: int, memory_bytes: int | None = None,
                    paged_kernel: bool = False) -> KVGeometry:
        """Resolve the pool's geometry. `memory_bytes`: the KV budget of a gpu_memory_utilization
        config (see `gpu_kv_budget`); `paged_kernel`: the device runs a paged attention
        kernel in place (then "auto" picks paged)."""
        layout = self._layout(paged_kernel)
        if self.num_slots is not None:
            return KVGeometry("slots", self.num_slots, self.max_seq_len, self.max_seq_len)
        if not self.memory_sized:
            tokens = self.kv_capacity_tokens or DEFAULT_KV_TOKENS
            return KVGeometry("paged", max(1, tokens // self.block_size), self.block_size, self.max_seq_len)
        budget = self.kv_cache_memory_bytes if self.kv_cache_memory_bytes is not None else memory_bytes
        if budget is None:
            raise ValueError("gpu_memory_utilization needs the device's KV budget (memory_bytes)")
        if bytes_per_token <= 0:
            raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
        tokens = budget // bytes_per_token
        want = self.max_seq_len or self.block_size
        if tokens < want:
            raise ValueError(
                f"KV memory {budget / GIB:.2f} GiB holds only {tokens} tokens ({bytes_per_token} bytes each), "
                f"less than one request of max_seq_len {want}; raise --kv-cache-memory-gb "
                "(kv_cache_memory_bytes) or --gpu-memory-utilization, or lower --max-seq-len")
        if layout == "slots":
            return KVGeometry("slots", min(tokens // want, self.max_running), want, want)
        blocks = tokens // self.block_size
        if self.max_seq_len:
            blocks = min(blocks, self.max_running * -(-self.max_seq_len // self.block_size))
        return KVGeometry("paged", blocks, self.block_size, self.max_seq_len)

    def _layout(self, paged_kernel: bool) -> str:
        if self.num_slots is not None:
            return "slots"
        if self.kv_capacity_tokens is not None or not self.memory_sized:
            return "paged"
        if self.kv_layout != "auto":
            return self.kv_layout
        if self.max_seq_len is None or paged_kernel:
            return "paged"
        return "slots"


def gpu_kv_budget(total_bytes: int, free_bytes: int, used_bytes: int, utilization: float) -> int:
    """KV bytes for gpu_memory_utilization: utilization x the device's total memory, less what
    this process already holds (weights, `used_bytes`). Raises ValueError saying what to change."""
    budget = int(total_bytes * utilization) - used_bytes
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {utilization} of {total_bytes / GIB:.1f} GiB leaves nothing for KV "
                         f"after the {used_bytes / GIB:.1f} GiB this process holds; raise --gpu-memory-utilization")
    if budget > free_bytes:
        raise ValueError(f"KV budget {budget / GIB:.1f} GiB exceeds the {free_bytes / GIB:.1f} GiB free on the device "
                         "(another process holds memory); lower --gpu-memory-utilization")
    return budget


def default_cpu_kv_bytes() -> int:
    """CPU KV budget when none is given: DEFAULT_CPU_KV_BYTES, at most a quarter of RAM."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf on this platform
        return DEFAULT_CPU_KV_BYTES
    return min(DEFAULT_CPU_KV_BYTES, ram // 4)
