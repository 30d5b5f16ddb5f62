"""bench/harness/proc_cpu.py: a process's CPU until it is first SERVING is starting work, after
that serving work; processes serving when the ledger starts count only from then on."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from bench.harness.proc_cpu import CpuLedger
from hasctl.profile_host import cpu_s

BURN = """
import sys, time
from pathlib import Path
def burn(s):
    t = time.process_time()
    while time.process_time() - t < s:
        pass
burn(float(sys.argv[1]))
Path(sys.argv[2]).touch()  # SERVING from here on
burn(float(sys.argv[3]))
time.sleep(60)
"""


class FakeStack:
    """The three things the ledger reads of a `hasctl.launch.Stack`, over real processes."""

    def __init__(self) -> None:
        self.procs: dict[str, tuple[subprocess.Popen, Path]] = {}
        self.spares: dict[str, subprocess.Popen] = {}

    def start(self, name: str, before_ready_s: float, after_ready_s: float, ready: Path) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", BURN, str(before_ready_s), str(ready), str(after_ready_s)])
        self.procs[name] = (p, ready)
        return p

    @property
    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, (p, _) in self.procs.items()}

    @property
    def spare_pids(self) -> dict[str, int | None]:
        return {n: p.pid for n, p in self.spares.items()}

    def healthy(self, name: str) -> bool:
        return self.procs[name][1].exists()


def wait_ready(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_starting_cpu_is_what_a_process_spent_before_it_served(tmp_path):
    stack = FakeStack()
    old = stack.start("old", 0.0, 0.6, tmp_path / "old")  # serving already when the ledger starts
    wait_ready(tmp_path / "old")
    try:
        with CpuLedger(stack, period_s=0.05) as ledger:
            new = stack.start("new", 0.8, 0.4, tmp_path / "new")  # a restart: 0.8 s to come up, then 0.4 s serving
            wait_ready(tmp_path / "new")
            deadline = time.monotonic() + 60
            while (cpu_s(new.pid) or 0) < 0.8 + 0.4 - 0.02 or (cpu_s(old.pid) or 0) < 0.6 - 0.02:  # ticks of 10 ms
                assert time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(0.2)
        s = ledger.summary(cores=2)
    finally:
        for p, _ in stack.procs.values():
            p.kill()
            p.wait()
    assert s["processes_started"] == 1
    assert 0.8 <= s["starting_cpu_s"] <= 0.8 + interpreter_start_s() + 0.3, s
    assert 0.4 + 0.6 - 0.3 <= s["serving_cpu_s"] <= 0.4 + 0.6 + 0.3, s  # old's CPU before the ledger: not counted
    assert abs(s["starting_share"] * 2 * ledger.wall_s - s["starting_cpu_s"]) < 0.06, s  # of 2 cores x wall (rounded)


_START: list[float] = []


def interpreter_start_s() -> float:
    """CPU seconds a bare `python -c pass` takes here (measured once)."""
    if not _START:
        p = subprocess.run([sys.executable, "-c", "import os; print(sum(os.times()[:2]))"],
                           capture_output=True, text=True, check=True)
        _START.append(float(p.stdout))
    return _START[0]
