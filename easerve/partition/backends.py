"""Mechanisms that realize an `Allocation` from `partitioner` on real hardware.

One interface, `SMBackend` (sm_backend.py): `levels` (the encode shares it can realize), `apply(allocation)`
(switch to the smallest level >= the requested encode share; returns its index),
`realized(level)` (the shares that level really gives each side: cores or SMs granted over the
total, which is what metrics report) and `encode_context(level)` / `prefill_context(level)`
(context managers to run each side's work under). `reason` says why this backend is the live
one; `degraded` is non-empty when it partitions less than was asked (`select_backend("auto")`
found no mechanism and time-slices, or a green-context level whose prefill remainder the driver
refused). Backends:

- GreenContextBackend: CUDA green contexts; per level, one SM split made up front into an
  encode group and a disjoint prefill group (cut from the remainder, see green_contexts),
  each with its own context and stream, so switching is picking a pre-created stream.
- MPSBackend: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, read by the driver at CUDA init, so the share
  is fixed per process at launch (`env_for(share)`); `apply` cannot change it.
- CpuAffinityBackend (cpu_affinity.py): splits the process's allowed cores between the encode and local-prefill
  worker threads with os.sched_setaffinity on their native thread ids.
- TimeSliceBackend (uncontrolled baseline) and StaticSplitBackend (fixed 50/50 baseline, on
  one of the mechanisms above built with the single level 0.5).

Selection (`select_backend`): a backend that cannot run here (no such device, library, driver
support or daemon; a driver call refused) raises `BackendUnavailable` from its constructor,
and only that: a mechanism named explicitly (`--sm-backend green_contexts`, ...) then fails
the start naming the flag; "auto" walks the chain and, when nothing can split, time-slices
with `degraded` saying why; "static" (or `exact=True`, the static policy) never degrades: no
mechanism means `BackendUnavailable`. Any other error (a ValueError for bad levels, a bug)
propagates under every preference: it is not a missing mechanism.

torch is imported lazily, and only by the CUDA code paths.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, ContextManager, Literal, Mapping, Sequence, get_args

from easerve.partition.cpu_affinity import CpuAffinityBackend
from easerve.partition.green_contexts import GreenContextBackend
from easerve.partition.sm_backend import BackendUnavailable, SMBackend, Worker, check_levels, stream_scope
from easerve.policy.partitioner import DEFAULT_SHARES, Allocation

Preference = Literal["auto", "green_contexts", "mps", "cpu_affinity", "timeslice", "static"]  # --sm-backend
PREFERENCES: tuple[str, ...] = get_args(Preference)
_ALIASES = {"dynamic": "auto", "green": "green_contexts", "cpu": "cpu_affinity"}


def _torch() -> Any:
    import torch
    return torch


class TimeSliceBackend(SMBackend):
    """No partition: on CUDA encode and prefill get two plain streams and the hardware
    interleaves them; on CPU both threads keep every allowed core."""

    name = "timeslice"

    def __init__(self, device: str = "cpu", reason: str = "uncontrolled time-slicing") -> None:
        super().__init__((1.0,), reason)
        self._streams = self._torch = None
        if device.startswith("cuda"):
            self._torch = torch = _torch()
            if not torch.cuda.is_available():
                raise RuntimeError(f"device {device!r} asked for but CUDA is not available")
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))

    def realized(self, level: int | None = None) -> Allocation:
        return Allocation(1.0, 1.0, 0)

    def encode_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        return self._ctx(0, sync)

    def prefill_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        return self._ctx(1, sync)

    def _ctx(self, i: int, sync: bool) -> ContextManager[Any]:
        if self._streams is None:
            return contextlib.nullcontext()
        return stream_scope(self._streams[i], sync, self._torch)


class StaticSplitBackend(SMBackend):
    """The fixed-split baseline: realizes `share` on `inner` (a mechanism built with that
    level) once and ignores `apply`. `realized()` is what `inner` really granted."""

    name = "static"

    def __init__(self, inner: SMBackend, share: float = 0.5) -> None:
        if not 0 < share < 1:
            raise ValueError(f"static share must be in (0, 1), got {share}")
        self.inner = inner
        super().__init__((share,), f"static {share:g}/{1 - share:g} split on {inner.name} ({inner.reason})")
        inner.apply(Allocation(share, round(1 - share, 9)))
        if inner.degraded:
            raise BackendUnavailable(f"the static split cannot be realized on {inner.name}: {inner.degraded}")

    def apply(self, allocation: Allocation) -> int:
        return 0

    def realized(self, level: int | None = None) -> Allocation:
        r = self.inner.realized()
        return Allocation(r.encode_share, r.prefill_share, 0)

    def bind(self, worker: Worker, tid: int | None = None) -> None:
        if hasattr(self.inner, "bind"):
            self.inner.bind(worker, tid)

    def encode_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        return self.inner.encode_context(None, sync)

    def prefill_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        return self.inner.prefill_context(None, sync)

    def close(self) -> None:
        self.inner.close()


class MPSBackend(SMBackend):
    """CUDA MPS: this process's share was fixed at CUDA init by its launcher. MPS caps per
    CUDA context and torch has one per process, so encode and the co-located prefill both run
    inside that cap and time-slice within it: `realized()` is (share, share)."""

    name = "mps"
    ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        ok, why = self.probe(env)
        if not ok:
            raise BackendUnavailable(why)
        share = int(env[self.ENV]) / 100
        super().__init__((share,), f"mps: {why}; apply() cannot change it at run time")
        self.mismatches = 0  # allocations asked for that this process cannot realize

    def apply(self, allocation: Allocation) -> int:
        self.mismatches += abs(allocation.encode_share - self.levels[0]) > 1e-9
        return 0

    def realized(self, level: int | None = None) -> Allocation:
        return Allocation(self.levels[0], self.levels[0], 0)

    @classmethod
    def env_for(cls, share: float) -> dict[str, str]:
        """Environment to launch a process with `share` of the SMs under MPS."""
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        return {cls.ENV: str(max(1, min(100, round(share * 100))))}

    @classmethod
    def probe(cls, env: Mapping[str, str]) -> tuple[bool, str]:
        pct = env.get(cls.ENV)
        if pct is None:
            return False, (f"{cls.ENV} is not set for this process (MPS shares are fixed per "
                           "process before CUDA init; launch it with MPSBackend.env_for(share))")
        if not pct.isdigit() or not 1 <= int(pct) <= 100:
            return False, f"{cls.ENV}={pct!r} is not an integer percentage in 1..100"
        pipe = env.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
        if not os.path.exists(os.path.join(pipe, "control")):
            return False, f"no MPS control daemon ({pipe}/control missing; run nvidia-cuda-mps-control -d)"
        return True, f"{cls.ENV}={pct} under the MPS daemon at {pipe}"


class PartitionController:
    """Glue for a worker: per micro-batch, policy `choose` -> mechanism `apply` -> run encode
    under that level's context. `encode_scope` is what services/encode calls per batch."""

    def __init__(self, partitioner: Any, backend: SMBackend, note: str = "") -> None:
        self.partitioner, self.backend, self.note = partitioner, backend, note
        self.requested: Allocation | None = None  # what the policy asked for the last batch
        self.last: Allocation | None = None       # what the backend realized for it

    @contextlib.contextmanager
    def encode_scope(self, batch_size: int):
        self.requested = self.partitioner.choose(batch_size)
        level = self.backend.apply(self.requested)
        self.last = self.backend.realized(level)
        with self.backend.encode_context(level):
            yield level

    def describe(self) -> dict[str, Any]:
        grid = self.partitioner.grid
        return {**self.backend.describe(), "policy": self.partitioner.policy, "note": self.note,
                "latency_grid": None if grid is None else dataclasses.asdict(grid),
                "requested": None if self.requested is None else vars(self.requested),
                "last": None if self.last is None else vars(self.last)}

    def prefill_scope(self) -> ContextManager[Any]:
        """Prefill work for the current level (enqueue it in chunks: work already queued on
        a stream keeps that stream's SMs until it finishes)."""
        return self.backend.prefill_context()


# ---- selection --------------------------------------------------------------------------
def select_backend(preference: str = "auto", device: str = "cpu",
                   levels: Sequence[float] = DEFAULT_SHARES,
                   env: Mapping[str, str] | None = None, *, exact: bool = False) -> SMBackend:
    """The backend for `preference` on `device` ("cpu", "cuda", "cuda:1"). `exact`: the
    levels must be realized as nearly as the hardware allows (the static policy): green
    contexts round to the nearest SM granule instead of up, and nothing degrades.
    Raises BackendUnavailable (naming --sm-backend) instead of silently time-slicing."""
    pref = _ALIASES.get(preference, preference)
    if pref not in PREFERENCES:
        raise ValueError(f"preference must be one of {PREFERENCES} (or {sorted(_ALIASES)}), "
                         f"got {preference!r}")
    cuda = device.startswith("cuda")
    index = int(device.split(":", 1)[1]) if cuda and ":" in device else 0
    if pref == "timeslice":
        return TimeSliceBackend(device, "timeslice requested: uncontrolled sharing")
    if pref == "static":
        inner = select_backend("auto", device, (0.5,), env, exact=True)
        return StaticSplitBackend(inner, 0.5)
    if pref != "auto":
        try:
            return _build(pref, cuda, index, levels, env, exact)
        except BackendUnavailable as e:
            raise BackendUnavailable(f"--sm-backend {pref} is not available on {device}: {e}. "
                                     "Pick another --sm-backend (auto takes the best one available here)") from e
    notes: list[str] = []
    for name in ["green_contexts", "mps"] if cuda else ["cpu_affinity"]:
        try:
            backend = _build(name, cuda, index, levels, env, exact)
        except BackendUnavailable as e:
            notes.append(f"{name} unavailable: {e}")
            continue
        if notes:
            backend.reason = f"{'; '.join(notes)} -> fell back to {name}: {backend.reason}"
        return backend
    why = "; ".join(notes)
    if exact:
        where = ("a GPU with green contexts (CUDA >= 12.8), or MPS with "
                 f"{MPSBackend.env_for(levels[0])[MPSBackend.ENV]} % active threads") if cuda \
            else ">= 2 cores (--device cpu:0-1)"
        raise BackendUnavailable(f"no mechanism on {device} can realize the split {list(levels)} ({why}); "
                                 f"run the static baseline on {where}, or use --partition-policy timeslice")
    ts = TimeSliceBackend(device, f"{why} -> no partition: time-slicing")
    ts.degraded = f"--sm-backend auto found no partition mechanism on {device} ({why}): encode and " \
                  "co-located prefill time-slice; --sm-backend timeslice asks for that explicitly"
    return ts


def _build(name: str, cuda: bool, index: int, levels: Sequence[float],
           env: Mapping[str, str] | None, exact: bool = False) -> SMBackend:
    if name == "green_contexts":
        if not cuda:
            raise BackendUnavailable("device is not CUDA")
        return GreenContextBackend(levels, index, rounding="nearest" if exact else "up", strict=exact)
    if name == "mps":
        if not cuda:
            raise BackendUnavailable("device is not CUDA")
        backend = MPSBackend(env)
        if exact and backend.levels != check_levels(levels):
            want = MPSBackend.env_for(levels[0])[MPSBackend.ENV]
            raise BackendUnavailable(f"{MPSBackend.ENV}={round(backend.levels[0] * 100)} gives encode "
                               f"{backend.levels[0]:g}; the split {list(levels)} needs "
                               f"{MPSBackend.ENV}={want} at launch")
        return backend
    if cuda:
        raise BackendUnavailable("core affinity does not partition a GPU")
    backend = CpuAffinityBackend(levels)
    if len(backend.cores) < 2:
        raise BackendUnavailable(f"only {len(backend.cores)} allowed core: nothing to split")
    return backend

