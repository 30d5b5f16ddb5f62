"""Where a stack's CPU goes while it runs: serving, or bringing processes back.

A `CpuLedger` samples `/proc/<pid>/stat` (user + system time) of every process a
`hasctl.launch.Stack` runs, its standbys included, every `period_s`. A process counts as
*starting* from its birth until the launcher's health check first finds it SERVING under its
name (a standby, until promoted and SERVING); its CPU up to then is restart work, after it
serving work. Processes SERVING when the ledger starts count as serving from then on. The
ledger loses at most one period of CPU per process that dies between samples.
"""
from __future__ import annotations

import os
import threading
import time

from hasctl.profile_host import cpu_s

class CpuLedger:
    def __init__(self, stack, period_s: float = 0.5) -> None:
        self.stack, self.period_s = stack, period_s
        self._last: dict[int, float] = {}      # pid -> CPU seconds at its last sample
        self._ready_at: dict[int, float] = {}  # pid -> CPU seconds when first seen SERVING
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.wall_s = 0.0

    def __enter__(self) -> CpuLedger:
        serving = set(self.stack.pids.values())
        for pid in self._pids():
            if (c := cpu_s(pid)) is not None:
                self._last[pid] = c  # its CPU before the ledger started is not counted
                if pid in serving:
                    self._ready_at[pid] = c
        self._base = dict(self._last)
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="cpu-ledger", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.wall_s = time.monotonic() - self._t0

    def _pids(self) -> set[int]:
        return {pid for pid in (*self.stack.pids.values(), *self.stack.spare_pids.values()) if pid}

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def _sample(self) -> None:
        serving = self.stack.pids
        for pid in self._pids() | self._last.keys():  # a drained instance, no longer listed, still counts
            if (c := cpu_s(pid)) is not None:
                self._last[pid] = c
        for name, pid in serving.items():
            if pid and pid in self._last and pid not in self._ready_at and self._healthy(name):
                self._ready_at[pid] = self._last[pid]

    def _healthy(self, name: str) -> bool:
        try:
            return self.stack.healthy(name)
        except KeyError:  # removed meanwhile
            return False

    def summary(self, cores: int | None = None) -> dict:
        """CPU seconds spent starting and serving since the ledger started, and their shares of
        the machine (`cores` x wall time)."""
        starting = serving = 0.0
        for pid, last in self._last.items():
            base = self._base.get(pid, 0.0)  # 0: born while the ledger ran
            ready = self._ready_at.get(pid, last)  # never SERVING: all of it was starting
            starting += max(0.0, ready - base)
            serving += last - max(ready, base)
        machine = (cores or os.cpu_count() or 1) * max(self.wall_s, 1e-9)
        return {"starting_cpu_s": round(starting, 1), "serving_cpu_s": round(serving, 1),
                "starting_share": round(starting / machine, 3), "serving_share": round(serving / machine, 3),
                "processes_started": sum(pid not in self._base for pid in self._last)}
