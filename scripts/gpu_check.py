#!/usr/bin/env python3
"""The one prepared GPU run: every GPU path of EAServe measured in sections, each a
subprocess under its own timeout, inside one time budget (7 minutes by default, sized for an
H200). Results go to $OUT/gpu-check.json (or --out), rewritten after every section; the last
stdout line is the same JSON. `--dry-run` runs every section on CPU against stand-ins.

    python scripts/gpu_check.py                      # on the GPU machine
    python scripts/gpu_check.py --dry-run --out /tmp/gpu-check.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hasctl.gpucheck.runner import Section, run_sections, section_command  # noqa: E402

# (section, timeout on an H200 in seconds); the sum stays inside the default budget
TIMEOUTS = (("preflight", 40), ("green_contexts", 30), ("colocation", 60), ("cuda_ipc", 45),
            ("decode", 120), ("e2e", 100))
DRY_TIMEOUTS = {"decode": 300, "e2e": 300}  # a 2-core CPU builds models and a stack slowly


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU stand-ins for every section")
    ap.add_argument("--out", default=None, help="result file (default: $OUT/gpu-check.json, else ./gpu-check.json)")
    ap.add_argument("--budget-s", type=float, default=None, help="total seconds (default 420; dry run 900)")
    ap.add_argument("--sections", default=",".join(n for n, _ in TIMEOUTS), help="comma-separated subset")
    args = ap.parse_args(argv)
    names = [n for n in args.sections.split(",") if n]
    known = dict(TIMEOUTS)
    if unknown := [n for n in names if n not in known]:
        ap.error(f"unknown sections {unknown}; choose from {list(known)}")
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "gpu-check.json"
    budget = args.budget_s or (900.0 if args.dry_run else 420.0)
    sections = [Section(n, section_command(n, args.dry_run),
                        DRY_TIMEOUTS.get(n, known[n] * 2) if args.dry_run else known[n]) for n in names]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    report = run_sections(sections, out, budget, dry_run=args.dry_run, env=env)
    print(json.dumps(report, default=str), flush=True)
    return 0 if all(s["status"] == "ok" for s in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
