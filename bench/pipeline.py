"""The serving stack under open-loop load, side by side with the monolith and (when set up) vLLM.

One run on the bench-scale Qwen2.5-VL checkpoint: Poisson arrivals of image chat requests at
3 rates up to saturation, for each deployment in turn (one server at a time on these cores,
alternating deployments within each rate): the multi-process preset (`--preset`) or deployment
file (`--deployment`, e.g. one `hasctl tune --out` wrote) under test, the
`monolith` preset (encode, prefill and decode in one process: the aggregated baseline), and
vLLM's CPU build on the same checkpoint when `../shared/peer/` has been set up (skipped with
the reason otherwise). The load client is `hasctl bench` (`hasctl.bench.run_bench`), the same
for every server. Per cell: P50/P99 TTFT, P50/P99 TPOT, throughput and goodput under the SLO.
Last stdout line: JSON with "stack_over_monolith_goodput" (at the worst rate for the stack;
target >= 1.0) and, when the peer ran, "stack_over_vllm_goodput".

  python bench/pipeline.py                       # rates 0.5,1,2 req/s, 40 requests per cell
  python bench/pipeline.py --rates 0.5,1,4 --requests 30 --deployment bench/deployments/cpu-2core-shared.yaml
  python bench/pipeline.py --rates 1,2,4 --requests 60 --preset colocated
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness import results, stack  # noqa: E402
from bench.harness.checkpoint import checkpoint  # noqa: E402
from bench.harness.load import hasctl_bench  # noqa: E402
PEER = Path(os.environ.get("PEER", Path.home() / ".cache" / "easerve-peer"))
def _peer_scripts() -> Path:
    """../shared/peer beside the checkout (or beside a parent folder: git worktrees live deeper)."""
    if os.environ.get("PEER_SCRIPTS"):
        return Path(os.environ["PEER_SCRIPTS"])
    for up in ROOT.parents:
        if (up / "shared" / "peer" / "serve.sh").exists():
            return up / "shared" / "peer"
    return ROOT.parent / "shared" / "peer"


PEER_SCRIPTS = _peer_scripts()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: bench-scale tiny qwen2.5-vl)")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny-qwen2.5-vl-bench"))
    ap.add_argument("--preset", default="default", help="the multi-process preset to measure")
    ap.add_argument("--deployment", default=None, help="or a deployment file (its model is replaced), e.g. "
                    "bench/deployments/cpu-2core-shared.yaml or a `hasctl tune --out` file")
    ap.add_argument("--rates", default="0.5,1,2")
    ap.add_argument("--requests", type=int, default=40, help="requests per cell")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--image-size", default="224x224")
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--tpot-ms", type=float, default=100.0)
    ap.add_argument("--no-peer", action="store_true", help="skip vLLM even when it is set up")
    ap.add_argument("--seed", type=int, default=0)
    results.add_save_flag(ap)
    args = ap.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    return args


# ---- servers -----------------------------------------------------------------------------------
class OurStack:
    def __init__(self, preset_name: str, model: str, path: str | None = None):
        self.d, self.stack = stack.deployment(model, preset_name, path, threads=None), None

    def __enter__(self) -> str:
        self.stack = stack.start(self.d, env={"EASERVE_LOG_LEVEL": "WARNING"})
        return self.stack.endpoints.http

    def __exit__(self, *exc) -> None:
        self.stack.stop()


class Vllm:
    name = "vllm"

    def __init__(self, model: str, port: int):
        self.model, self.port, self.proc = model, port, None

    @staticmethod
    def missing() -> str | None:
        if not (PEER / "venv" / "bin" / "vllm").exists():
            return f"vLLM's CPU build is not set up ({PEER}/venv/bin/vllm absent; run ../shared/peer/setup.sh)"
        if not (PEER_SCRIPTS / "serve.sh").exists():
            return f"{PEER_SCRIPTS}/serve.sh is missing"
        return None

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(
            [str(PEER_SCRIPTS / "serve.sh"), self.model, "vllm-peer", str(self.port),
             "--limit-mm-per-prompt", '{"image":1,"video":0}'],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{self.port}"
        end = time.monotonic() + 600
        while time.monotonic() < end:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                return url
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("vLLM exited while starting")
                time.sleep(2)
        raise TimeoutError("vLLM did not become healthy in 600 s")

    def __exit__(self, *exc) -> None:
        import signal
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


# ---- one cell --------------------------------------------------------------------------------
def measure(url: str, args, rate: float, label: str) -> tuple[dict, dict]:
    """The cell, and the run as `hasctl report` reads it."""
    from easerve.slo import SLO
    from hasctl.workload import WorkloadSpec, parse_size
    work = WorkloadSpec(modality="image", image_size=parse_size(args.image_size), output_tokens=args.output_tokens)
    res = hasctl_bench(url, work, rate, args.requests, args.seed, label, SLO(args.ttft_ms, args.tpot_ms))
    m = res.metrics
    return {k: m.get(k) for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                                  "request_throughput", "request_goodput", "completed", "failed")}, res.to_dict()


def main(argv=None) -> int:
    args = parse_args(argv)
    model = checkpoint(args.model, args.cache_dir)
    servers = [("stack", lambda: OurStack(args.preset, model, args.deployment)),
               ("monolith", lambda: OurStack("monolith", model))]
    peer_skip = "--no-peer" if args.no_peer else Vllm.missing()
    if peer_skip is None:
        from hasctl.launch import free_port
        servers.append(("vllm", lambda: Vllm(model, free_port())))
    else:
        print(f"vllm: skipped ({peer_skip})", file=sys.stderr)
    cells: dict[tuple[str, float], dict] = {}
    rows = []
    for i, rate in enumerate(args.rates):
        order = servers if i % 2 == 0 else servers[::-1]  # alternate who goes first
        for name, make in order:
            with make() as url:
                cells[(name, rate)], row = measure(url, args, rate, name)
                rows.append(row)
            print(f"{name:9s} rate {rate:5.2f}: {json.dumps(cells[(name, rate)])}", file=sys.stderr, flush=True)
    print(f"{'server':9s} {'rate':>5s} {'ttft p50':>9s} {'ttft p99':>9s} {'tpot p50':>9s} {'tpot p99':>9s} "
          f"{'thru':>6s} {'goodput':>7s}")
    for (name, rate), c in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{name:9s} {rate:5.2f} {c['median_ttft_ms']:9.1f} {c['p99_ttft_ms']:9.1f} {c['median_tpot_ms']:9.1f} "
              f"{c['p99_tpot_ms']:9.1f} {c['request_throughput']:6.2f} {c['request_goodput']:7.2f}")
    ratio = lambda other: min(  # noqa: E731 - the stack's worst rate against `other` at that rate
        (cells[("stack", r)]["request_goodput"] / max(cells[(other, r)]["request_goodput"], 1e-9), r)
        for r in args.rates)
    out = {"stack_over_monolith_goodput": round(ratio("monolith")[0], 3), "worst_rate": ratio("monolith")[1]}
    if peer_skip is None:
        out["stack_over_vllm_goodput"] = round(ratio("vllm")[0], 3)
    out.update({"preset": args.deployment or args.preset, "rates": args.rates, "requests_per_cell": args.requests,
                "slo_ms": [args.ttft_ms, args.tpot_ms], "peer": "ran" if peer_skip is None else peer_skip,
                "cells": {f"{n}@{r}": c for (n, r), c in cells.items()}})
    results.finish("pipeline", args, out, argv, lambda: results.report_plots(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
