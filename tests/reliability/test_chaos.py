"""The chaos soak's 90-second version (`bench/chaos.py --quick`, issue 34): 2 encode, 2 prefill and
2 decode instances of the bench-scale random-weight Qwen2.5-VL, each process and each restart
forked from the stack's fork server, admission on, at 2x the measured capacity, with instances
killed (kill -9), stopped (SIGSTOP 5 s) and drained on a seeded schedule: no accepted request is
lost or hangs, no answer gains or loses a token against the fault-free run of the same requests,
nothing leaks, every malformed request gets 400, and the SLO (a multiple of the stack's own
unloaded latency) is met by some requests of the clean run, so goodput has a reference."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.load]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1500)
def test_chaos_quick_loses_nothing_hangs_nothing_and_leaks_nothing(tiny_root, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)}
    cmd = [sys.executable, str(REPO / "bench" / "chaos.py"), "--quick", "--no-save", "--scale", "bench",
           "--cache-dir", str(tiny_root), "--out", str(tmp_path / "chaos.json")]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1400)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["faults"] == {"kill": 8, "stop": 2, "drain": 1}, result["faults"]
    assert result["completed"] > 0 and result["tokens_checked"] > 0, result
    bad = {k: result[k] for k in ("lost", "hung", "duplicated_or_missing_tokens", "leaks", "malformed_not_400")
           if result[k] != 0}
    assert not bad, (bad, result["lost_details"], result["leak_detail"], result["fd_growth"], result["fault_errors"])
    assert result["rejected_invalid"] > 0                      # the 5 % malformed were sent and refused 400
    assert result["goodput_faults_over_clean"] is not None, result["slo"]  # the clean run met its SLO
