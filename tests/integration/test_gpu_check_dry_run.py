"""`gpu_check.py --dry-run`: every section of the GPU run on CPU against stand-ins (a fake
driver, same-process shared memory for CUDA IPC, CPU decode, a CPU stack), through the same
runner: one JSON schema, written to the file and printed as the last stdout line."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["preflight", "green_contexts", "colocation", "cuda_ipc", "decode", "e2e"]


def _run(tmp_path, *extra):
    out = tmp_path / "gpu-check.json"
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(out), *extra],
                       capture_output=True, text=True, timeout=1500)
    return p, out


def test_dry_run_quick_sections(tmp_path) -> None:
    p, out = _run(tmp_path, "--sections", "preflight,green_contexts,colocation,cuda_ipc")
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report == json.loads(out.read_text()) and report["dry_run"] is True
    s = report["sections"]
    assert list(s) == SECTIONS[:4] and all(v["status"] == "ok" for v in s.values()), s
    assert s["preflight"]["result"]["round_trip"]["prefill"]["sms"] == 56  # 132 SMs: 72 + a 56-SM group
    assert set(s["green_contexts"]["result"]["levels"]) == {"0.25", "0.5", "0.75"}
    assert set(s["colocation"]["result"]) == {"timeslice", "static", "dynamic"}
    assert s["cuda_ipc"]["result"]["58MB"]["transport_gbps"] > 0
    assert p.returncode == 0


@pytest.mark.load  # ~10 min on 2 cores: with the long tests (.ci/run's second command)
def test_dry_run_every_section(tmp_path) -> None:
    p, out = _run(tmp_path)
    report = json.loads(out.read_text())
    assert list(report["sections"]) == SECTIONS
    assert all(v["status"] == "ok" for v in report["sections"].values()), report["sections"]
    e2e = report["sections"]["e2e"]["result"]
    assert e2e["answered"] == e2e["requests"] > 0 and e2e["backends"]
