"""Service times from a profile (`easerve.profile_format.Profile`, duck-typed), shared by the
simulator (easerve/sim) and the serving latency predictor (easerve/policy/latency.py).

- gateway: `profile.gateway_latency(modality, media)` per request (0 in a revision-1 profile);
- encode: `profile.encode_latency(batch, share, modality, media)`; a batch mixing media is the sum
  of its groups' (`encode_batch_s`, also the latency predictor's: easerve/policy/latency.py);
- prefill of a batch: `profile.prefill_latency(mean prompt length, batch size)`;
- decode step: `profile.decode_step_s(batch, mean context)`;
- each from the profile taken with the instance's tensor-parallel degree: an instance with tp=k
  spans the GPUs cuda:N .. cuda:N+k-1 and reads the profile whose `tp` is k (the main one, or one
  of `profiles`); media rows and transfer sizes come from the main profile;
- transfers: `latency_s + bytes / GB/s` of the link kind between the two devices (0 when the
  profile has no `transfer` section); links are not modelled as contended;
- interference (easerve/sim/compute.py): a job's slowdown at each moment, re-evaluated whenever
  a worker that shares its device or cores starts or ends a job (processor sharing):
  - workers of one process (an encode instance and its co-located prefill), and on a GPU any
    workers whose GPU groups intersect: 1 + the sum of (`profile.slowdown(stage, by)` - 1) over
    the busy ones, a pair the profile measured (in one process: `hasctl profile` runs the two
    in two threads); a pair it did not measure counts CPU_SHARE_SLOWDOWN (2.0) on CPU cores and
    1.0 on a GPU;
  - workers of other processes on the same CPU cores: times `sharing(stage, busy)` with k of
    them busy: the profile's sharing curve at k (`hasctl profile` times each stage while k
    processes running one stage compute on its cores; for a mix, the mean over the k of the
    curve of each one's stage), or, for a profile without one, 1 + k (CPU_SHARE_SLOWDOWN - 1):
    k + 1 compute-bound processes with a thread per core each run at 1 / (k + 1) speed;
  - a worker launched with the shared-cores environment (its CPU cores are another process's
    too): times `shared_env(stage)` throughout, the profile's measured cost of that environment;
  - a monolith's encode, prefill and decode are workers of one process (ModelConfig.monolith
    "threads", the default), or with "serial" they take turns and never slow each other.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from easerve.fields import cpu_cores

CPU_SHARE_SLOWDOWN = 2.0  # an unprofiled pair of busy workers on the same CPU cores
DEFAULT_MEDIA_TOKENS = 64  # placeholders per media item when the profile lists no by_size point for it


MONOLITH_MODES = ("threads", "serial")
HOST_STAGES = ("gateway", "encode", "prefill", "decode", "monolith")


@dataclass(frozen=True)
class ModelConfig:
    """`devices_per_host`: GPUs per node (cuda:N lives on node N // devices_per_host); CPU
    devices are all on node 0. `monolith`: how a monolith's encode, prefill and decode share
    its process: "threads" (as the service runs them: concurrently, each slowed by the
    profile's in-process pairs while another runs) or "serial" (one at a time, in turns: a
    process whose interpreter and thread pool admit one stage at a time).
    `host_s`: (stage, seconds) pairs, the host CPU one request costs each stage process outside
    model compute (parsing, media, tokenization, serialization, gRPC, streaming; stages
    "gateway", "encode", "prefill", "decode", "monolith"): charged as a job of one thread on
    that process's cores (easerve/sim/host.py), so it takes core time from the model's jobs
    on shared CPU cores and queues behind the process's other host work; measured with
    hasctl/profile_host.py (`hasctl profile --host-work`). Empty: none. The gateway's share
    includes its preprocessing (the profile's gateway points, `gateway_s`), which runs on its
    preprocessing threads: the simulator charges that part there and the rest on arrival.
    `request_overhead_s`: what a live stack adds to every request besides the profiled calls
    and `host_s` (process wake-ups, the polling of the gRPC hops): a delay before the gateway
    takes the request, taking no core time; measured as a stack's unloaded TTFT over the
    simulator's for the same request (bench/sim_fidelity.py does so per stack), 0 by default."""
    devices_per_host: int = 8
    monolith: str = "threads"
    request_overhead_s: float = 0.0
    host_s: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.devices_per_host < 1:
            raise ValueError(f"devices_per_host must be >= 1, got {self.devices_per_host}")
        if self.monolith not in MONOLITH_MODES:
            raise ValueError(f"monolith must be one of {MONOLITH_MODES}, got {self.monolith!r}")
        if not self.request_overhead_s >= 0.0:
            raise ValueError(f"request_overhead_s must be >= 0 seconds, got {self.request_overhead_s}")
        for stage, sec in self.host_s:
            if stage not in HOST_STAGES or not sec >= 0.0:
                raise ValueError(f"host_s: each entry is (stage, seconds >= 0) with stage one of {HOST_STAGES}; "
                                 f"got ({stage!r}, {sec!r})")

    def host_of(self, stage: str) -> float:
        """Host CPU seconds per request of `stage`'s process (0 when not given)."""
        return sum(sec for s, sec in self.host_s if s == stage)


class ServiceModel:
    cores_shared = True  # host threads and model jobs slow each other on shared CPU cores (False: the
    #                      times already include it, as call times measured under the same load do)

    def __init__(self, profile: Any, config: ModelConfig | None = None, profiles: Sequence[Any] = ()) -> None:
        self.profile = profile
        self.config = config or ModelConfig()
        self.by_tp: dict[int, Any] = {}
        for p in (profile, *profiles):
            tp = int(getattr(p, "tp", 1))
            if self.by_tp.setdefault(tp, p) is not p:
                raise ValueError(f"two profiles were given for tp={tp}; give one profile per tensor-parallel degree")
        self._cache: dict[tuple, float] = {}
        enc = profile.encode
        self._tokens = {(p.modality, p.media): p.tokens_per_item for p in (enc.by_size if enc else ())}

    def for_tp(self, tp: int, where: str = "an instance") -> Any:
        """The profile taken with `--tp tp`."""
        p = self.by_tp.get(tp)
        if p is None:
            raise ValueError(f"{where} has tp={tp} but no profile taken with tp={tp} was given (have tp "
                             f"{sorted(self.by_tp)}); add one (hasctl profile --roofline --tp {tp} ...; "
                             f"hasctl simulate --tp-profile FILE) or set the instance's tp to one of those")
        return p

    def check_group(self, device: str, tp: int, where: str) -> None:
        """The instance's GPUs lie on one node and its tp has a profile."""
        self.for_tp(tp, where)
        g = gpu_group(device, tp)
        if g and g[0] // self.config.devices_per_host != g[-1] // self.config.devices_per_host:
            raise ValueError(f"{where} spans cuda:{g[0]}..cuda:{g[-1]}, across nodes of "
                             f"{self.config.devices_per_host} GPUs; start it on one node")

    # ---- per stage --------------------------------------------------------------------------
    def gateway_s(self, modality: str, media: str) -> float:
        return self._memo(("g", modality, media), lambda: self.profile.gateway_latency(modality, media or None))

    def encode_s(self, batch: int, share: float, modality: str, media: str, tp: int = 1) -> float:
        prof = self.for_tp(tp)

        def f() -> float:
            try:
                return prof.encode_latency(batch, share, modality, media)
            except ValueError:  # no by_size point for this media: the reference grid as it is
                return prof.encode_latency(batch, share)
        return self._memo(("e", batch, share, modality, media, tp), f)

    def encode_batch_s(self, mix: dict[tuple[str, str], int], share: float = 1.0, tp: int = 1) -> float:
        """One encode batch of `mix` ((modality, media) -> items): each group at its batch size."""
        return sum(self.encode_s(n, share, m, media, tp) for (m, media), n in mix.items() if n > 0)

    def media_tokens(self, modality: str, media: str) -> int:
        if modality == "text":
            return 0
        exact = self._tokens.get((modality, media))
        if exact is not None:
            return exact
        same = [n for (m, _), n in self._tokens.items() if m == modality]
        return max(same) if same else DEFAULT_MEDIA_TOKENS

    def prefill_s(self, total_tokens: int, batch: int, tp: int = 1) -> float:
        mean = max(1, round(total_tokens / batch))
        return self._memo(("p", mean, batch, tp), lambda: self.for_tp(tp).prefill_latency(mean, batch))

    def decode_step_s(self, batch: int, context: int, tp: int = 1) -> float:
        ctx = 1 << max(0, int(context).bit_length() - 1)  # memo by power of two; nearest point is taken anyway
        return self._memo(("d", batch, ctx, tp), lambda: self.for_tp(tp).decode_step_s(batch, context))

    def slowdown(self, stage: str, by: str, cpu: bool = False) -> float:
        """`stage`'s latency factor while a `by` worker is busy on its device (`cpu`: on its cores)."""
        def f() -> float:
            measured = any(x.stage == stage and x.by == by for x in getattr(self.profile, "interference", ()) or ())
            return self.profile.slowdown(stage, by) if measured or not cpu else CPU_SHARE_SLOWDOWN
        return self._memo(("s", stage, by, cpu), f)

    def sharing(self, stage: str, busy: tuple[str, ...]) -> float:
        """`stage`'s latency factor while workers of other processes, running the stages `busy`
        (sorted), compute on its CPU cores: the profile's curve at k = len(busy) for each kind of
        neighbour, weighted by how many of them run it."""
        def f() -> float:
            k, measured = len(busy), getattr(self.profile, "sharing_slowdown", None)
            vals = [measured(stage, by, k) if measured is not None else None for by in busy]
            if any(v is None for v in vals):
                return 1.0 + k * (CPU_SHARE_SLOWDOWN - 1.0)
            return sum(vals) / k
        return self._memo(("sh", stage, busy), f)

    def shared_env(self, stage: str) -> float:
        """`stage`'s latency factor in a worker launched with the shared-cores environment, no
        neighbour busy: the profile's `shared_env` point (1.0 when it has none)."""
        def f() -> float:
            measured = getattr(self.profile, "shared_env_slowdown", None)
            return measured(stage) if measured is not None else 1.0
        return self._memo(("env", stage), f)

    def cores(self, device: str) -> int:
        """CPU cores of `device` ('cpu:0-3'), or the profile machine's for plain 'cpu'."""
        c = cpu_cores(device)
        return len(c) if c else max(1, int(getattr(getattr(self.profile, "hardware", None), "cores", 1) or 1))

    # ---- transfers ----------------------------------------------------------------------------
    def link_kind(self, a: str, b: str) -> str:
        if a == b:
            return "same_device"
        return "same_host" if self.host(a) == self.host(b) else "other_host"

    def host(self, device: str) -> int:
        if device.startswith("cuda:"):
            return int(device[5:]) // self.config.devices_per_host
        return 0

    def transfer_s(self, nbytes: int, kind: str) -> float:
        link = self.profile.link(kind) if self.profile.transfer is not None else None
        return 0.0 if link is None else link.latency_s + nbytes / (link.gb_per_s * 1e9)

    def embed_bytes(self, tokens: int) -> int:
        t = self.profile.transfer
        return 0 if t is None else tokens * t.embed_bytes_per_token

    def kv_bytes(self, tokens: int) -> int:
        t = self.profile.transfer
        return 0 if t is None else tokens * t.kv_bytes_per_token

    def kv_bytes_per_token(self) -> int | None:
        t = self.profile.transfer
        return None if t is None else t.kv_bytes_per_token

    def _memo(self, key: tuple, f) -> float:
        v = self._cache.get(key)
        if v is None:
            v = self._cache[key] = float(f())
        return v


def gpu_group(device: str, tp: int = 1) -> tuple[int, ...]:
    """The GPU indices of an instance on `device` spanning `tp` GPUs (plain `cuda` is cuda:0); () on CPU."""
    if device == "cuda":
        return tuple(range(tp))
    if device.startswith("cuda:") and device[5:].isdigit():
        return tuple(range(int(device[5:]), int(device[5:]) + tp))
    return ()


def shares_compute(a: str, b: str, tp_a: int = 1, tp_b: int = 1) -> bool:
    """Two instances share compute: intersecting GPU groups, or overlapping CPU cores (plain `cpu` is all)."""
    if a.startswith("cuda") or b.startswith("cuda"):
        return bool(set(gpu_group(a, tp_a)) & set(gpu_group(b, tp_b)))
    ca, cb = cpu_cores(a), cpu_cores(b)
    return ca is None or cb is None or bool(set(ca) & set(cb))
