"""gpu_check's runner: each section a subprocess under its own timeout (a hanging one is cut,
with what it started, and the rest still run), a section that cannot fit in what is left of
the budget is skipped, and the JSON file is rewritten after every section."""
from __future__ import annotations

import json
import sys

from hasctl.gpucheck.runner import SCHEMA, STATUSES, Section, run_sections

PY = sys.executable


def _py(code: str) -> tuple[str, ...]:
    return (PY, "-c", code)


def test_hanging_section_is_cut_and_the_rest_run(tmp_path) -> None:
    out = tmp_path / "gpu-check.json"
    sections = [
        Section("first", _py("import json; print('noise'); print(json.dumps({'x': 1}))"), 20),
        # hangs, and so does the child it started: both go with its process group
        Section("hangs", _py("import subprocess, sys, time; print('{\"partial\": 1}', flush=True); "
                             f"subprocess.Popen([{PY!r}, '-c', 'import time; time.sleep(300)']); time.sleep(300)"), 2),
        Section("fails", _py("import sys; sys.exit('boom')"), 20),
        Section("last", _py("print('{\"y\": 2}')"), 20),
    ]
    report = run_sections(sections, out, budget_s=120)
    s = report["sections"]
    assert report["schema"] == SCHEMA and list(s) == ["first", "hangs", "fails", "last"]
    assert s["first"]["status"] == "ok" and s["first"]["result"] == {"x": 1}
    assert s["hangs"]["status"] == "timeout" and s["hangs"]["seconds"] < 15 and "cut after 2 s" in s["hangs"]["error"]
    assert s["hangs"]["result"] == {"partial": 1}
    assert s["fails"]["status"] == "error" and "boom" in s["fails"]["error"]
    assert s["last"]["status"] == "ok" and s["last"]["result"] == {"y": 2}
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    for entry in s.values():
        assert set(entry) == {"status", "timeout_s", "seconds", "result", "error"} and entry["status"] in STATUSES


def test_a_section_that_cannot_fit_is_skipped(tmp_path) -> None:
    t = iter([0.0, 0.0, 50.0, 50.0, 95.0, 95.0, 96.0])  # the clock as the runner reads it
    sections = [Section("a", _py("print('{}')"), 30), Section("b", _py("print('{}')"), 30),
                Section("c", _py("print('{}')"), 30)]
    report = run_sections(sections, tmp_path / "r.json", budget_s=100, clock=lambda: next(t))
    got = {k: v["status"] for k, v in report["sections"].items()}
    assert got == {"a": "ok", "b": "ok", "c": "skipped"}
    assert "5 s of the 100 s budget left" in report["sections"]["c"]["error"]


def test_the_file_is_rewritten_after_every_section(tmp_path) -> None:
    out = tmp_path / "r.json"
    # the second section reads the file the runner left after the first
    reader = _py(f"import json; d = json.load(open({str(out)!r})); print(json.dumps({{'seen': list(d['sections'])}}))")
    report = run_sections([Section("one", _py("print('{}')"), 20), Section("two", reader, 20)], out, budget_s=60)
    assert report["sections"]["two"]["result"] == {"seen": ["one"]}
