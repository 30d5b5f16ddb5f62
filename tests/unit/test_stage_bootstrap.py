"""easerve.stages.common.stop_early: a stage asked to stop while it still imports or loads exits 0."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOADING = """
import asyncio, sys
from easerve.stages.common import stop_early
stop_early.install()  # as each services.<stage> entry point does first
from easerve.stages.common.cli import run_stage
from easerve.stages.common.configs import GatewayConfig

async def main(cfg):  # a stage still loading its model: serve() not reached yet
    print("loading", flush=True)
    await asyncio.sleep(60)

sys.argv = ["gateway", "--model", "m", "--encode", "127.0.0.1:1", "--prefill", "127.0.0.1:2",
            "--decode", "127.0.0.1:3"]
run_stage(GatewayConfig, "gateway", main)
"""


def test_sigterm_before_serving_exits_zero_with_nothing_to_drain(tmp_path):
    # A drained standby promoted a moment before (the chaos soak's drain) was killed by the
    # signal's default action, exit code -15, as if the drain had failed.
    script = tmp_path / "stage.py"
    script.write_text(LOADING)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout.readline().strip() == "loading"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "SIGTERM before serving: nothing accepted, exiting" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _catches_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def test_sigterm_while_a_stage_imports_exits_zero(tmp_path):
    # A cold restart drained seconds after it began (importing torch) died of the signal, exit -15.
    proc = subprocess.Popen([sys.executable, "-m", "services.prefill", "--model", str(tmp_path / "none"),
                             "--decode", "127.0.0.1:1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    try:
        deadline = time.monotonic() + 20
        while not _catches_sigterm(proc.pid):         # the entry point's first line has run
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.005)
        assert "torch" not in _loaded(proc.pid)        # still importing: the model code is not loaded yet
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _loaded(pid: int) -> str:
    """The shared objects the process has mapped (torch's once it imports it)."""
    return "\n".join(line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if ".so" in line)
