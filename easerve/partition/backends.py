"""Mechanisms that realize an `Allocation` from `partitioner` on real hardware.

One interface, `SMBackend`: `levels` (the encode shares it can realize), `apply(allocation)`
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
from typing import Any, ClassVar, ContextManager, Literal, Mapping, Sequence, get_args

from easerve.policy.partitioner import DEFAULT_SHARES, Allocation

Worker = Literal["encode", "prefill"]
WORKERS: tuple[str, ...] = ("encode", "prefill")
Preference = Literal["auto", "green_contexts", "mps", "cpu_affinity", "timeslice", "static"]  # --sm-backend
PREFERENCES: tuple[str, ...] = get_args(Preference)
_ALIASES = {"dynamic": "auto", "green": "green_contexts", "cpu": "cpu_affinity"}


def _torch() -> Any:
    import torch
    return torch


class BackendUnavailable(RuntimeError):
    """The partition asked for cannot be realized here (the mechanism is missing or refused);
    the message says why, and `select_backend` names the flag to change."""


def _check_levels(levels: Sequence[float]) -> tuple[float, ...]:
    lv = tuple(float(x) for x in levels)
    if not lv or list(lv) != sorted(set(lv)) or not all(0 < x <= 1 for x in lv):
        raise ValueError(f"levels must be strictly increasing shares in (0, 1], got {list(levels)}")
    return lv


class SMBackend:
    """Base: bookkeeping of the live level; subclasses override `_switch` and the contexts.
    `encode_context(level, sync)`: level None = the level of the last `apply`; `sync` (CUDA
    only) makes the block's GPU work complete on exit."""

    name: ClassVar[str] = "base"
    dynamic: ClassVar[bool] = False  # can apply() change the split at run time?

    def __init__(self, levels: Sequence[float], reason: str) -> None:
        self.levels = _check_levels(levels)
        self.reason = reason
        self.degraded = ""  # why this backend partitions less than asked ("" = it does not)
        self.level = len(self.levels) - 1  # start encode-protective

    def realized(self, level: int | None = None) -> Allocation:
        """The shares `level` (default: the live one) gives encode and prefill. Prefill 0.0
        means it has nothing of its own and time-slices with encode (the partitioner's
        convention at share 1.0)."""
        i = self.level if level is None else level
        share = self.levels[i]
        return Allocation(share, 0.0 if share >= 1.0 else round(1.0 - share, 9), i)

    def level_for(self, encode_share: float) -> int:
        """Index of the smallest level >= encode_share (the largest level if none is)."""
        for i, lv in enumerate(self.levels):
            if lv >= encode_share - 1e-9:
                return i
        return len(self.levels) - 1

    def apply(self, allocation: Allocation) -> int:
        idx = self.level_for(allocation.encode_share)
        if idx != self.level:
            self._switch(idx)
            self.level = idx
        return idx

    def _switch(self, idx: int) -> None:
        pass

    def encode_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def prefill_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "reason": self.reason, "levels": list(self.levels),
                "level": self.level, "dynamic": self.dynamic, "degraded": self.degraded,
                "realized": [vars(self.realized(i)) for i in range(len(self.levels))]}

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(levels={self.levels}, level={self.level}, reason={self.reason!r})"


class TimeSliceBackend(SMBackend):
    """No partition: on CUDA encode and prefill get two plain streams and the hardware
    interleaves them; on CPU both threads keep every allowed core."""

    name = "timeslice"

    def __init__(self, device: str = "cpu", reason: str = "uncontrolled time-slicing") -> None:
        super().__init__((1.0,), reason)
        self._streams = None
        if device.startswith("cuda"):
            torch = _torch()
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
        return _stream_scope(self._streams[i], sync)


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


@contextlib.contextmanager
def _stream_scope(stream: Any, sync: bool, enter: Any = None, torch: Any = None):
    """Run a block on `stream`, after the work already queued on the caller's current stream
    (inputs it uploaded). `enter`: for a stream of another CUDA context (a green context), a
    scope that makes that context current; the wait on the caller's stream is set up before
    it, so that event is recorded in the caller's context, and events recorded inside the
    block belong to `stream`'s context (an event may only be recorded on a stream of its own
    context; a stream may wait on an event of any). With `sync`, the exit waits on the host
    for this stream alone, so results are ready for any thread or stream and the other
    side's stream keeps running; without it the caller orders the hand-off with CUDA events.
    (A GPU-side wait of the shared default stream instead would chain encode and prefill
    back together.)"""
    torch = _torch() if torch is None else torch
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with enter() if enter is not None else contextlib.nullcontext(), torch.cuda.stream(stream):
        yield stream
    if sync:
        stream.synchronize()


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
        from easerve.partition.green_contexts import GreenContextBackend
        return GreenContextBackend(levels, index, rounding="nearest" if exact else "up", strict=exact)
    if name == "mps":
        if not cuda:
            raise BackendUnavailable("device is not CUDA")
        backend = MPSBackend(env)
        if exact and backend.levels != _check_levels(levels):
            want = MPSBackend.env_for(levels[0])[MPSBackend.ENV]
            raise BackendUnavailable(f"{MPSBackend.ENV}={round(backend.levels[0] * 100)} gives encode "
                               f"{backend.levels[0]:g}; the split {list(levels)} needs "
                               f"{MPSBackend.ENV}={want} at launch")
        return backend
    if cuda:
        raise BackendUnavailable("core affinity does not partition a GPU")
    from easerve.partition.cpu_affinity import CpuAffinityBackend
    backend = CpuAffinityBackend(levels)
    if len(backend.cores) < 2:
        raise BackendUnavailable(f"only {len(backend.cores)} allowed core: nothing to split")
    return backend

