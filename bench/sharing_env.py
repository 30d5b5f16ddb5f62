"""The CPU sharing curve under the two OpenMP wait policies, side by side in one run.

`hasctl profile` times each stage's reference call alone and while k other processes run a
reference call in a loop on the same cores (hasctl/profile_sharing.py). Stages that share cores
run with SHARED_CORES_ENV (OpenMP threads that sleep at a barrier: hasctl/deployment.py); a curve
timed with libgomp's default (threads spin at a barrier) describes a machine the stages do not run on.
This bench measures the curve both ways, interleaved `--rounds` times, on the bench-scale
checkpoint, and prints each point's median slowdown per policy.

  python bench/sharing_env.py                 # bench scale, k = 1, 2, 2 rounds (about 6 min here)
  python bench/sharing_env.py --quick         # tiny checkpoint, k = 1, 1 round
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import results  # noqa: E402
from bench.harness.checkpoint import checkpoint  # noqa: E402
from hasctl.deployment import SHARED_CORES_ENV  # noqa: E402
from hasctl.profile_sharing import run_measurement  # noqa: E402

# measured by the profiler's own code (hasctl.profile_sharing.run_measurement) under each environment
POLICIES = {"default": {}, "shared_cores_env": dict(SHARED_CORES_ENV)}  # default: libgomp's (threads spin)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved measurements per policy")
    ap.add_argument("--max-busy", type=int, default=2, help="neighbour processes, 1 .. this")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs"), help="where the checkpoint is built")
    ap.add_argument("--quick", action="store_true", help="tiny checkpoint, k = 1, one round")
    results.add_save_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.max_busy = 1, 1
    model = checkpoint(None, args.cache_dir, scale="tiny" if args.quick else "bench")
    import torch
    threads, cores = torch.get_num_threads(), len(os.sched_getaffinity(0))
    runs: dict[str, list[list[dict]]] = {k: [] for k in POLICIES}
    for r in range(args.rounds):
        for name, env in POLICIES.items():
            runs[name].append(run_measurement(model, threads, args.max_busy, cores, args.quick, env))
            print(f"round {r} {name} done", file=sys.stderr, flush=True)
    table: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        by: dict[str, list[float]] = {}
        for pts in rs:
            for p in pts:
                by.setdefault(f"{p['stage']}|{p['by']}x{p['busy']}", []).append(p["slowdown"])
        table[name] = {k: round(statistics.median(v), 2) for k, v in sorted(by.items())}
    ratio = {k: round(table["default"][k] / table["shared_cores_env"][k], 2) for k in table["default"]}
    result = {"threads": threads, "cores": cores, "rounds": args.rounds,
              "slowdown": table, "default_over_shared_cores_env": ratio,
              "default_over_shared_cores_env_median": round(statistics.median(ratio.values()), 2)}
    results.finish("sharing_env", args, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
