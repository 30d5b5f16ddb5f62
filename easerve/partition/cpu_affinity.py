"""CpuAffinityBackend: the CPU's partition mechanism (an `easerve.partition.sm_backend.SMBackend`,
selected by `easerve.partition.backends`): the process's allowed cores split between the encode and local-prefill worker
threads with os.sched_setaffinity on their native thread ids."""
from __future__ import annotations

import contextlib
import math
import os
import threading
from typing import Any, ContextManager, Sequence

from easerve.partition.sm_backend import WORKERS, BackendUnavailable, SMBackend, Worker, check_levels
from easerve.policy.partitioner import DEFAULT_SHARES, Allocation


class CpuAffinityBackend(SMBackend):
    """Core split per level: encode gets ceil(share x n) cores (at least 1), prefill the rest;
    when nothing is left (share 1.0, or one core) prefill shares all cores (time-slices).
    So share 0.5 is exactly half on an even count; on an odd one encode gets the extra core
    (3 cores: 2 + 1), and `realized` reports 2/3.

    Bound threads (`bind`) are moved by `apply` itself; an unbound thread can pin itself for a
    block with `encode_context` / `prefill_context`. Only the bound threads move: helper
    threads they already spawned (e.g. an OpenMP pool) keep the affinity they started with."""

    name = "cpu_affinity"
    dynamic = True

    def __init__(self, levels: Sequence[float] = DEFAULT_SHARES,
                 cores: Sequence[int] | None = None) -> None:
        if not hasattr(os, "sched_setaffinity"):
            raise BackendUnavailable("os.sched_setaffinity is not available on this platform")
        self.cores = tuple(sorted(os.sched_getaffinity(0) if cores is None else cores))
        if not self.cores:
            raise ValueError("cores must not be empty")
        lv = check_levels(levels)
        self._splits = tuple(self._split(s) for s in lv)
        self._tids: dict[str, int] = {}
        self.lost: list[tuple[str, int]] = []  # bound threads that disappeared
        super().__init__(lv, f"cpu core split over {len(self.cores)} allowed cores {list(self.cores)}")

    def _split(self, share: float) -> tuple[frozenset[int], frozenset[int]]:
        n = len(self.cores)
        k = min(n, max(1, math.ceil(share * n - 1e-9)))
        enc, rest = self.cores[:k], self.cores[k:]
        return frozenset(enc), frozenset(rest or self.cores)

    def realized(self, level: int | None = None) -> Allocation:
        i = self.level if level is None else level
        enc, pre = self._splits[i]
        n = len(self.cores)
        if enc & pre:  # prefill has no cores of its own
            return Allocation(1.0 if len(enc) == n else len(enc) / n, 0.0, i)
        return Allocation(len(enc) / n, len(pre) / n, i)

    def cores_for(self, worker: Worker, level: int | None = None) -> frozenset[int]:
        lv = self.level if level is None else level
        return self._splits[lv][WORKERS.index(worker)]

    def bind(self, worker: Worker, tid: int | None = None) -> None:
        """Register a worker thread (native id; default: the calling thread) and pin it now."""
        if worker not in WORKERS:
            raise ValueError(f"worker must be one of {WORKERS}, got {worker!r}")
        self._tids[worker] = threading.get_native_id() if tid is None else tid
        self._pin_bound(worker, self.level)

    def current_affinity(self, worker: Worker) -> frozenset[int]:
        """What the kernel says the bound worker may run on now."""
        return frozenset(os.sched_getaffinity(self._tids[worker]))

    def _switch(self, idx: int) -> None:
        for w in list(self._tids):
            self._pin_bound(w, idx)

    def _pin_bound(self, worker: str, idx: int) -> None:
        tid = self._tids[worker]
        try:
            os.sched_setaffinity(tid, self._splits[idx][WORKERS.index(worker)])
        except ProcessLookupError:
            self._tids.pop(worker, None)
            self.lost.append((worker, tid))

    def encode_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        return self._pin_self("encode", level)

    def prefill_context(self, level: int | None = None, sync: bool = True) -> ContextManager[Any]:
        return self._pin_self("prefill", level)

    @contextlib.contextmanager
    def _pin_self(self, worker: Worker, level: int | None):
        if self._tids.get(worker) == threading.get_native_id() and level is None:
            yield  # bound: apply() already moved this thread
            return
        prev = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.cores_for(worker, level))
        try:
            yield
        finally:
            os.sched_setaffinity(0, prev)
