"""A device spec (`specs/*.json`): vendor datasheet figures and the efficiency factors that turn a
`Cost` into seconds.

    seconds = layers * layer_overhead_s + call_overhead_s
              + max(flops / (tflops * 1e12 * compute_eff * share),
                    bytes / (mem_gb_per_s * 1e9 * memory_eff * min(1, 2 * share)))
              + allreduces * allreduce_latency_s + 2 (tp-1)/tp * allreduce_bytes / (interconnect_gb_per_s * 1e9)

(an encode call adds `encode_call_overhead_s`: hasctl/roofline_profile.py, `RooflineModel.encode_s`),
with flops and bytes divided by `tp` (an instance spanning tp devices splits each layer's weights
and heads evenly). `share` is the SM (or core) share of a partitioned device: compute scales with
it, memory bandwidth saturates at half the SMs (stated assumption). The factors are each
spec's `efficiency` block; the CPU's are fitted by bench/roofline_check.py, the GPUs' are stated
(typical of large bf16 GEMMs and streaming reads on those parts) until a measured GPU profile fits them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from easerve.roofline.cost import Cost


@dataclass(frozen=True)
class Efficiency:
    compute: float = 0.6          # of peak dense TFLOP/s reached by the model's matmuls
    memory: float = 0.8           # of peak memory bandwidth reached by weight / KV reads
    layer_overhead_s: float = 2e-5  # per layer per call: kernel launches (GPU) or dispatch (CPU)
    call_overhead_s: float = 1e-4   # per call: the framework's fixed cost
    allreduce_latency_s: float = 1e-5
    # per encode call, on top: a serving stack's fixed cost outside the tower's kernels (the call's
    # inputs to the device, the tower's Python, the embeddings' way out); a batch pays it once.
    # 0 in the shipped specs (a roofline); bench/paper_setting.py fits it to the paper's table
    encode_call_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for k in ("compute", "memory"):
            if not 0 < getattr(self, k) <= 1:
                raise ValueError(f"efficiency.{k} must be in (0, 1], got {getattr(self, k)}")
        for k in ("layer_overhead_s", "call_overhead_s", "allreduce_latency_s", "encode_call_overhead_s"):
            if getattr(self, k) < 0:
                raise ValueError(f"efficiency.{k} must be >= 0 seconds, got {getattr(self, k)}")


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    tflops: float                 # dense matmul TFLOP/s in `dtype` (bf16 on GPUs, no sparsity)
    mem_gb_per_s: float
    mem_gib: float
    sm_count: int                 # SMs (GPU) or cores (CPU)
    interconnect_gb_per_s: float  # device-to-device, one direction (NVLink, or PCIe when there is none)
    source: str                   # where the figures come from
    dtype: str = "bf16"
    efficiency: Efficiency = Efficiency()

    def __post_init__(self) -> None:
        for k in ("tflops", "mem_gb_per_s", "mem_gib", "sm_count", "interconnect_gb_per_s"):
            if not getattr(self, k) > 0:
                raise ValueError(f"spec {self.name!r}: {k} must be > 0, got {getattr(self, k)}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"spec {self.name!r}: dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def seconds(self, cost: Cost, share: float = 1.0, tp: int = 1) -> float:
        if not 0 < share <= 1 or tp < 1:
            raise ValueError(f"share must be in (0, 1] and tp >= 1, got share={share}, tp={tp}")
        e = self.efficiency
        compute = cost.flops / tp / (self.tflops * 1e12 * e.compute * share)
        memory = cost.bytes / tp / (self.mem_gb_per_s * 1e9 * e.memory * min(1.0, 2 * share))
        t = cost.layers * e.layer_overhead_s + e.call_overhead_s + max(compute, memory)
        if tp > 1:
            t += cost.allreduces * e.allreduce_latency_s + \
                2 * (tp - 1) / tp * cost.allreduce_bytes / (self.interconnect_gb_per_s * 1e9)
        return t

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceSpec":
        d = dict(d)
        try:
            eff = Efficiency(**d.pop("efficiency", {}))
            return cls(**d, efficiency=eff)
        except TypeError as e:
            raise ValueError(f"bad device spec {d.get('name', '?')!r}: {e}; fields are name, tflops, mem_gb_per_s, "
                             "mem_gib, sm_count, interconnect_gb_per_s, source, dtype, efficiency") from None


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def spec_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("easerve.roofline.specs").iterdir() if p.name.endswith(".json"))


def load_spec(name_or_path: str) -> DeviceSpec:
    """A shipped spec by name (`spec_names()`), or a JSON file of the same fields."""
    if name_or_path.endswith(".json") or "/" in name_or_path:
        try:
            return DeviceSpec.from_dict(json.loads(Path(name_or_path).read_text()))
        except OSError as e:
            raise ValueError(f"cannot read the device spec {name_or_path!r}: {e.strerror}") from None
    if name_or_path not in spec_names():
        raise ValueError(f"unknown GPU {name_or_path!r}; shipped specs: {spec_names()} (or give a SPEC.json)")
    text = resources.files("easerve.roofline.specs").joinpath(f"{name_or_path}.json").read_text()
    return DeviceSpec.from_dict(json.loads(text))
