"""The results store: every bench's last-line JSON, with the command, commit and machine it came
from, kept under bench/results/<bench>/ (committed; small).

`bench/results/<bench>/result.json` = {"bench", "command", "commit", "machine": {"cpu", "cores",
"gpu", "python", "torch"}, "date" (ISO 8601 UTC), "result"}; each plot beside it as
`<plot>.png` (dpi 80). docs/benchmarks.md is generated from these files: keep the field names.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
DPI = 80


def add_save_flag(ap: argparse.ArgumentParser) -> None:
    """--save / --no-save; unset, a full run saves and a --quick run does not (see should_save)."""
    ap.add_argument("--save", action=argparse.BooleanOptionalAction, default=None,
                    help="write the result (and plots) to bench/results/<bench>/ (default: on for a full run, "
                         "off with --quick)")


def should_save(args: argparse.Namespace) -> bool:
    return args.save if args.save is not None else not getattr(args, "quick", False)


def commit() -> str | None:
    """`git rev-parse --short HEAD`, with "-dirty" when the working tree has changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    try:
        import torch
        version = torch.__version__
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        version, gpu = None, None
    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)), "gpu": gpu,
            "python": platform.python_version(), "torch": version}


def save_result(bench: str, result: dict, argv: list[str] | None = None, plots: dict | None = None,
                out_dir: str | Path | None = None) -> Path:
    """Write result.json (and each matplotlib figure of `plots` as <name>.png) into
    out_dir (default bench/results/<bench>/); returns the JSON's path. `argv`: the script's
    arguments (default sys.argv[1:])."""
    out = Path(out_dir) if out_dir is not None else RESULTS / bench
    out.mkdir(parents=True, exist_ok=True)
    args = sys.argv[1:] if argv is None else list(argv)
    doc = {"bench": bench, "command": shlex.join(["python", f"bench/{bench}.py", *args]), "commit": commit(),
           "machine": machine(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "result": result}
    path = out / "result.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    for name, fig in (plots or {}).items():
        fig.savefig(out / f"{name}.png", dpi=DPI)
        fig.clf()
    return path


def report_plots(rows: list[dict], trace: dict | None = None) -> dict:
    """`hasctl report`'s figures of runs (scoring.report_row): goodput vs rate with the SLO,
    the latency CDFs and, given an encode /trace reply, the encode utilization."""
    from hasctl import report
    figs = {"goodput_vs_rate": report.goodput_figure(rows), "latency_cdf": report.cdf_figure(rows)}
    if trace is not None:
        figs["encode_utilization"] = report.trace_figure(trace)
    return figs


def finish(bench: str, args: argparse.Namespace, result: dict, argv: list[str] | None = None,
           plots=None, folder: str | None = None) -> None:
    """The end of every bench: print the result as the last stdout line and, when `args` asks
    for it (should_save), store it. `plots`: figures, or a call that makes them (only called when saving);
    `folder`: the results folder when one bench keeps several runs (default: the bench's name)."""
    if should_save(args):
        figs = plots() if callable(plots) else plots
        path = save_result(bench, result, argv, figs, None if folder is None else RESULTS / folder)
        print(f"saved {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}", file=sys.stderr)
    print(json.dumps(result), flush=True)
