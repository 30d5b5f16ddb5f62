"""Run the GPU check's sections, each as its own subprocess under its own timeout, within one
time budget: a section whose timeout no longer fits in what is left is skipped (with the
reason), a section that overruns is killed with its process group and the next one runs.
After every section the whole result is rewritten to the output file (atomically), so a run
cut short still leaves every figure it got; the last stdout line is the same JSON.

A section's command prints one JSON object as its last stdout line: its result."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

SCHEMA = "easerve.gpu-check/1"
STATUSES = ("ok", "error", "timeout", "skipped")


@dataclass(frozen=True)
class Section:
    name: str
    argv: tuple[str, ...]   # the subprocess that runs it
    timeout_s: float

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or not self.argv:
            raise ValueError(f"section {self.name!r} needs a command and a timeout > 0 s")


def run_sections(sections: Sequence[Section], out_path: Path, budget_s: float, *, dry_run: bool = False,
                 clock: Callable[[], float] = time.monotonic, env: dict | None = None) -> dict:
    start = clock()
    report = {"schema": SCHEMA, "dry_run": dry_run, "started": datetime.now(timezone.utc).isoformat(),
              "budget_s": budget_s, "elapsed_s": 0.0, "sections": {}}
    for s in sections:
        left = budget_s - (clock() - start)
        if left < s.timeout_s:
            entry = {"status": "skipped", "timeout_s": s.timeout_s, "seconds": 0.0, "result": None,
                     "error": f"{left:.0f} s of the {budget_s:.0f} s budget left, the section may take {s.timeout_s:.0f} s"}
        else:
            entry = _run_one(s, env)
        report["sections"][s.name] = entry
        report["elapsed_s"] = round(clock() - start, 3)
        write_atomic(out_path, report)
    return report


def _run_one(s: Section, env: dict | None) -> dict:
    t0 = time.monotonic()
    proc = subprocess.Popen(list(s.argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=s.timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        return {"status": "timeout", "timeout_s": s.timeout_s, "seconds": round(time.monotonic() - t0, 3),
                "result": _last_json(out), "error": f"cut after {s.timeout_s:.0f} s; stderr: {_tail(err)}"}
    seconds = round(time.monotonic() - t0, 3)
    result = _last_json(out)
    if proc.returncode != 0 or result is None:
        why = f"exit {proc.returncode}" if proc.returncode else "no JSON on the last stdout line"
        return {"status": "error", "timeout_s": s.timeout_s, "seconds": seconds, "result": result,
                "error": f"{why}; stderr: {_tail(err)}"}
    return {"status": "ok", "timeout_s": s.timeout_s, "seconds": seconds, "result": result, "error": ""}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the section's own session: it and what it started
    except ProcessLookupError:
        pass


def _last_json(out: str | None) -> dict | None:
    for line in reversed((out or "").strip().splitlines()):
        try:
            got = json.loads(line)
        except ValueError:
            return None
        return got if isinstance(got, dict) else None
    return None


def _tail(text: str | None, n: int = 1500) -> str:
    return (text or "").strip()[-n:]


def write_atomic(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)


def section_command(name: str, dry_run: bool) -> tuple[str, ...]:
    return (sys.executable, "-m", "hasctl.gpucheck.sections", name, *(["--dry-run"] if dry_run else []))
