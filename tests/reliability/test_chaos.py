"""The chaos soak's 90-second version (`bench/chaos.py --quick`): at 2x the measured capacity, with
instances killed, stopped and drained on a seeded schedule, no accepted request is lost or hangs,
no answer gains or loses a token against the fault-free run, and nothing leaks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from easerve.models.tiny import cached_tiny
from tests.integration.conftest import tiny_root  # noqa: F401 - the fixture

pytestmark = [pytest.mark.slow, pytest.mark.load]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1800)
def test_chaos_quick_loses_nothing(tiny_root, tmp_path):  # noqa: F811
    model = cached_tiny("qwen2.5-vl", tiny_root)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)}
    cmd = [sys.executable, str(REPO / "bench" / "chaos.py"), "--quick", "--model", str(model),
           "--out", str(tmp_path / "chaos.json")]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1700)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["sent"] > 0 and result["completed"] > 0, result
    assert result["faults"]["kill"] == 8 and result["faults"]["drain"] == 1, result
    bad = {k: result[k] for k in ("lost", "hung", "duplicated_or_missing_tokens", "leaks") if result[k] != 0}
    assert not bad, (bad, result["lost_details"], result["leak_detail"], result["fault_errors"])
    assert result["malformed_not_400"] == 0, result
