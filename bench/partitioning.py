"""Co-located encode + prefill under the three partition policies, side by side in one run.

The paper's experiment (DESIGN §4, paper: Ultravox at 10 req/s on a GPU, dynamic vs
time-slicing: +9 % throughput, -16 % P99 TTFT, -29 % P99 TPOT): one encode worker with its
prefill co-located (`--colocate-prefill --remote-fraction 0`: every prefill runs in the encode
process, on the same cores) and a decode worker, on the bench-scale Qwen2.5-VL checkpoint. The
same seeded Poisson trace of image chat requests at the same rate is replayed by `hasctl bench`
(`hasctl.bench.run_bench`) against the stack under each policy in turn:

- dynamic:   `--partition-policy dynamic` (per micro-batch share from the start-up profile)
- timeslice: `--partition-policy timeslice` (no partition: both sides on every core)
- static:    `--partition-policy static` (exactly half the cores each)

With --repeats N the policies run N times in rotated order (each stack started fresh) and a
cell is the median over repeats. On CPU the mechanism is core affinity (`--sm-backend auto`);
the encode process runs `--threads 2` so that an unpartitioned encode does spread over both
cores. Last stdout line: JSON with dynamic_over_timeslice_{throughput,ttft_p99,tpot_p99} and
static_over_timeslice_* (throughput: higher is better; the latency ratios: lower is better),
and the cells.

  python bench/partitioning.py --quick            # 1 repeat, 12 requests per cell
  python bench/partitioning.py --rate 1 --requests 40 --repeats 2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness import results, stack  # noqa: E402
from bench.harness.checkpoint import checkpoint  # noqa: E402
from bench.harness.load import hasctl_bench  # noqa: E402
POLICIES = ("dynamic", "timeslice", "static")
KEYS = ("request_throughput", "output_throughput", "p99_ttft_ms", "p99_tpot_ms", "median_ttft_ms",
        "median_tpot_ms", "completed", "failed")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: bench-scale tiny qwen2.5-vl)")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny-qwen2.5-vl-bench"))
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson, seeded)")
    ap.add_argument("--requests", type=int, default=40, help="requests per cell")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--image-size", default="224x224")
    ap.add_argument("--max-batch", type=int, default=8, help="B of the encode worker")
    ap.add_argument("--encode-threads", type=int, default=2)
    ap.add_argument("--profile-batch-sizes", default="1,4",
                    help="batch sizes of the dynamic policy's start-up profile (x 5 shares; measured once)")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds for a stack to be SERVING")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="12 requests, 8 output tokens, 1 repeat")
    results.add_save_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.output_tokens, args.repeats = 12, 8, 1
    return args


def deployment(model: str, policy: str, args, profile: str):
    from hasctl.deployment import Worker
    enc = Worker(flags={"colocate-prefill": True, "remote-fraction": 0.0, "max-batch": args.max_batch,
                        "batch-mode": "adaptive", "partition-policy": policy, "threads": args.encode_threads,
                        **({"partition-profile": profile, "profile-batch-sizes": args.profile_batch_sizes}
                           if policy == "dynamic" else {})})
    d = stack.deployment(model, "colocated", threads=None)
    return dataclasses.replace(d, encode=(enc,), name=f"colocated-{policy}")


def partition_of(st) -> dict:
    """The live backend and last realized split of the encode worker (its /partition)."""
    info = json.loads(stack.get(st.endpoints.metrics["encode-0"] + "/partition"))
    return {k: info.get(k) for k in ("backend", "policy", "degraded", "last")}


def measure(model: str, policy: str, args, profile: str) -> tuple[dict, dict]:
    """The cell of one policy, and its run as `hasctl report` reads it."""
    from hasctl.workload import WorkloadSpec, parse_size
    work = WorkloadSpec(modality="image", image_size=parse_size(args.image_size), output_tokens=args.output_tokens)
    st = stack.start(deployment(model, policy, args, profile), metrics=True, env={"EASERVE_LOG_LEVEL": "WARNING"},
                     timeout=args.start_timeout)
    try:
        res = hasctl_bench(st.endpoints.http, work, args.rate, args.requests, args.seed, label=policy)
        cell = {k: res.metrics.get(k) for k in KEYS}
        cell["partition"] = partition_of(st)
        cell["max_send_lag_ms"] = round(res.max_send_lag_ms, 1)
    finally:
        st.stop()
    return cell, res.to_dict()


def median_cells(runs: list[dict]) -> dict:
    out = {k: statistics.median(r[k] for r in runs) for k in KEYS if all(r.get(k) is not None for r in runs)}
    out["partition"] = runs[-1]["partition"]
    return out


def ratios(cells: dict, name: str) -> dict:
    a, t = cells[name], cells["timeslice"]
    div = lambda x, y: round(x / y, 3) if y else None  # noqa: E731
    return {f"{name}_over_timeslice_throughput": div(a["request_throughput"], t["request_throughput"]),
            f"{name}_over_timeslice_ttft_p99": div(a["p99_ttft_ms"], t["p99_ttft_ms"]),
            f"{name}_over_timeslice_tpot_p99": div(a["p99_tpot_ms"], t["p99_tpot_ms"])}


def main(argv=None) -> int:
    args = parse_args(argv)
    model = checkpoint(args.model, args.cache_dir)
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    rows = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="easerve-part-") as tmp:
        profile = os.path.join(tmp, "encode-partition.json")  # dynamic profiles once, then reuses it
        for rep in range(args.repeats):
            order = POLICIES[rep % 3:] + POLICIES[:rep % 3]
            for policy in order:
                cell, row = measure(model, policy, args, profile)
                rows.append(row)
                runs[policy].append(cell)
                print(f"repeat {rep} {policy:9s}: {json.dumps(cell)}", file=sys.stderr, flush=True)
    cells = {p: median_cells(r) for p, r in runs.items()}
    print(f"{'policy':9s} {'thru req/s':>10s} {'tok/s':>7s} {'ttft p99':>9s} {'tpot p99':>9s} {'ttft p50':>9s} "
          f"{'tpot p50':>9s} {'done':>5s}  backend / last split")
    for p in POLICIES:
        c = cells[p]
        part = c["partition"]
        split = part.get("last") or {}
        print(f"{p:9s} {c['request_throughput']:10.3f} {c['output_throughput']:7.1f} {c['p99_ttft_ms']:9.1f} "
              f"{c['p99_tpot_ms']:9.1f} {c['median_ttft_ms']:9.1f} {c['median_tpot_ms']:9.1f} "
              f"{c['completed']:5.0f}  {part.get('backend')} "
              f"{split.get('encode_share')}/{split.get('prefill_share')}")
    out = {**ratios(cells, "dynamic"), **ratios(cells, "static"),
           "rate": args.rate, "requests_per_cell": args.requests, "repeats": args.repeats,
           "output_tokens": args.output_tokens, "image_size": args.image_size, "cores": len(os.sched_getaffinity(0)),
           "load_avg_1m_end": round(os.getloadavg()[0], 2), "wall_s": round(time.monotonic() - t0, 1),
           "cells": cells}
    results.finish("partitioning", args, out, argv, lambda: results.report_plots(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
