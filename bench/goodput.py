"""Goodput of the tuned deployment vs the paper's baselines, per modality, in one run.

For each modality, on its bench-scale checkpoint (`hasctl make-tiny --scale bench`): image on
LLaVA-NeXT, video on Qwen2.5-VL, audio on Ultravox:

1. probe (the `dynamo-like` preset alone): the unloaded TTFT / TPOT (median of a few requests
   sent one at a time) give the SLO, `--slo-mult` x each (4 = DESIGN section 6's moderate
   tier); a burst of requests sent at once gives dynamo-like's saturated throughput C; the rate
   is `--load-factor` x C, so dynamo-like is saturated there by construction (both stated in
   the output);
2. tune: `hasctl tune`'s own search (`hasctl.trials.run_trials`, Optuna TPE, seeded; every trial a
   real launch) over allocations of up to 3 instances on this process's CPU cores, split and
   shared placements, B and s, and the monolith, at that rate and SLO, starting from the
   `default` / `colocated` / `monolith` points (`tune_space.warm_starts`); its wall time is
   `tune_minutes`;
3. measure: the best trial's deployment, `dynamo-like`, `fixed-batch-8` and `monolith`, one
   server at a time (order alternating between modalities), each on the same seeded trace
   (Poisson, `--requests`, every request decoding `--output-tokens`).

Prints and saves (`--out-dir`: goodput.md, goodput.json, tune.db, the stacks' logs) the table
with the trial count and tuning time; last stdout line: JSON with "easerve_over_dynamo_like",
"easerve_over_monolith", "easerve_over_fixed8" (each per modality; targets >= 2, >= 1, >= 1)
and "tune_minutes" (a ratio is null where the baseline met no SLO at all: "goodput" has the raw
req/s).

  python bench/goodput.py                          # 3 modalities, 8 trials, 40 requests per cell
  python bench/goodput.py --quick                  # smoke: 2 trials, 8 requests per cell
  python bench/goodput.py --modalities video --trials 12 --requests 60
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness.checkpoint import checkpoint  # noqa: E402
from bench.harness import stack  # noqa: E402
from bench.harness.results import add_save_flag, finish  # noqa: E402

from hasctl.bench import BenchConfig, run_bench  # noqa: E402
from easerve.slo import SLO  # noqa: E402
from hasctl.deployment import Deployment, preset  # noqa: E402
from hasctl.trials import TrialFailed, TuneConfig, best_deployment, best_trial, evaluate, open_study, run_trials  # noqa: E402
from hasctl.tune_space import PLACEMENTS, Space, core_devices, runnable_allocations, warm_starts  # noqa: E402
from hasctl.workload import WorkloadSpec  # noqa: E402

FAMILIES = {"image": "llava-next", "video": "qwen2.5-vl", "audio": "ultravox"}
BASELINES = ("dynamo-like", "fixed-batch-8", "monolith")
KEYS = {"dynamo-like": "easerve_over_dynamo_like", "monolith": "easerve_over_monolith",
        "fixed-batch-8": "easerve_over_fixed8"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modalities", default="image,video,audio")
    ap.add_argument("--trials", type=int, default=8, help="tune trials per modality")
    ap.add_argument("--requests", type=int, default=40, help="requests per measured cell")
    ap.add_argument("--tune-requests", type=int, default=24, help="requests per tune trial")
    ap.add_argument("--probe-requests", type=int, default=16, help="burst size of the saturation probe")
    ap.add_argument("--load-factor", type=float, default=1.3, help="rate = this x dynamo-like's saturated throughput")
    ap.add_argument("--slo-mult", type=float, default=4.0, help="SLO = this x the unloaded TTFT and TPOT")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--image-size", default="224x224")
    ap.add_argument("--video-frames", type=int, default=8)
    ap.add_argument("--audio-s", type=float, default=2.0)
    ap.add_argument("--instances", type=int, default=3, help="most E+P+D instances of a tuned allocation")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs"), help="where the bench-scale checkpoints are built")
    ap.add_argument("--out-dir", default=None, help="default: runs/goodput-<time>")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 trials, 8 requests per cell, 6 per trial")
    add_save_flag(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.trials, args.requests, args.tune_requests, args.probe_requests = 2, 8, 6, 6
    args.modalities = [m.strip() for m in args.modalities.split(",") if m.strip()]
    bad = [m for m in args.modalities if m not in FAMILIES]
    if bad:
        ap.error(f"--modalities: {bad} unknown; choose from {sorted(FAMILIES)}")
    args.out_dir = Path(args.out_dir or ROOT / "runs" / time.strftime("goodput-%Y%m%d-%H%M%S"))
    return args


def workload(args, modality: str) -> WorkloadSpec:
    from hasctl.workload import parse_size
    return WorkloadSpec(modality=modality, image_size=parse_size(args.image_size), video_frames=args.video_frames,
                        audio_s=args.audio_s, output_tokens=args.output_tokens)


# ---- 1. probe ---------------------------------------------------------------------------------
def probe(args, model: str, spec: WorkloadSpec, run_dir: Path) -> dict:
    """dynamo-like alone: unloaded TTFT/TPOT (one request at a time) and saturated throughput."""
    from hasctl.trials import stop_uninterrupted
    st = None
    try:
        st = stack.start(stack.deployment(model, "dynamo-like", threads=None), env={"EASERVE_LOG_LEVEL": "WARNING"},
                         run_dir=run_dir)
        url = st.endpoints.http

        def bench(rate: float, n: int, seed: int) -> dict:
            return asyncio.run(run_bench(BenchConfig(url=url, rate=rate, num_requests=n, seed=seed, workload=spec,
                                                     ignore_eos=True, progress=False))).metrics
        bench(100.0, 2, args.seed + 7)  # warm-up
        one = [bench(100.0, 1, args.seed + 11 + i) for i in range(3)]
        burst = bench(1000.0, args.probe_requests, args.seed + 17)
    finally:
        if st is not None:
            stop_uninterrupted(st)
    ttft = statistics.median(m["median_ttft_ms"] for m in one)
    tpot = statistics.median(m["median_tpot_ms"] for m in one)
    return {"unloaded_ttft_ms": ttft, "unloaded_tpot_ms": tpot,
            "dynamo_like_saturated_rps": burst["request_throughput"], "burst_requests": args.probe_requests,
            "slo_ms": [args.slo_mult * ttft, args.slo_mult * tpot],
            "rate": round(args.load_factor * burst["request_throughput"], 3)}


# ---- 2. tune ----------------------------------------------------------------------------------
def tune(args, cfg: TuneConfig, modality: str, say) -> tuple[Deployment, dict]:
    cores = sorted(os.sched_getaffinity(0))
    space = Space(tuple(runnable_allocations(args.instances)), core_devices(cores),
                  placements=PLACEMENTS if len(cores) > 1 else PLACEMENTS[:1])
    name = f"goodput-{modality}-{args.out_dir.name}"
    study, _ = open_study(f"sqlite:///{args.out_dir / 'tune.db'}", name, cfg.seed,
                          lambda s: dataclasses.replace(cfg, seed=s).fingerprint(space), warm=warm_starts(space))
    t0 = time.monotonic()
    run_trials(study, space, cfg, args.trials,
               lambda d, n: evaluate(d, cfg, Path(cfg.run_dir) / f"trial-{n}"), say)
    minutes = (time.monotonic() - t0) / 60
    best = best_trial(study)
    if best is None:
        raise RuntimeError(f"{modality}: no tune trial completed; see the logs in {cfg.run_dir}")
    d = best_deployment(study).with_gateway_ports(0, 0)
    return d, {"trials": args.trials, "tune_minutes": round(minutes, 2), "best_trial": best.number,
               "best_params": best.params, "best_tune_goodput": best.value}


# ---- 3. measure -------------------------------------------------------------------------------
def measure_all(cfg: TuneConfig, tuned: Deployment, model: str, flip: bool, say) -> dict[str, dict]:
    servers = [("easerve", tuned)] + [(b, preset(b).with_model(model).with_gateway_ports(0, 0)) for b in BASELINES]
    cells = {}
    for name, d in (servers[::-1] if flip else servers):
        try:
            m = evaluate(d, cfg, Path(cfg.run_dir) / f"measure-{name}")
        except TrialFailed as e:
            m = {"error": str(e), "request_goodput": 0.0}
        cells[name] = {k: m.get(k) for k in ("request_goodput", "request_throughput", "median_ttft_ms",
                                             "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "completed",
                                             "failed", "error")}
        say(f"  {name:14s} {json.dumps(cells[name])}")
    return cells


def ratio(ours: float | None, base: float | None) -> float | None:
    """ours / base; None when the baseline met no SLO (then see the raw goodputs)."""
    ours, base = ours or 0.0, base or 0.0
    return round(ours / base, 3) if base > 0 else None


def run_modality(args, modality: str, flip: bool, say) -> dict:
    model, spec = checkpoint(None, args.cache_dir, FAMILIES[modality]), workload(args, modality)
    run_dir = args.out_dir / modality
    say(f"[{modality}] {FAMILIES[modality]} bench-scale checkpoint {model}; probing dynamo-like")
    pr = probe(args, model, spec, run_dir / "probe")
    say(f"[{modality}] unloaded TTFT {pr['unloaded_ttft_ms']:.0f} ms, TPOT {pr['unloaded_tpot_ms']:.1f} ms -> SLO "
        f"{pr['slo_ms'][0]:.0f} / {pr['slo_ms'][1]:.1f} ms; dynamo-like saturates at "
        f"{pr['dynamo_like_saturated_rps']:.2f} req/s -> rate {pr['rate']} req/s")
    cfg = TuneConfig(model=model, rate=pr["rate"], slo=SLO(*pr["slo_ms"]), num_requests=args.tune_requests,
                     warmup=2, seed=args.seed, workload=spec, ignore_eos=True, run_dir=str(run_dir / "tune"))
    tuned, tn = tune(args, cfg, modality, say)
    say(f"[{modality}] tuned in {tn['tune_minutes']:.1f} min ({tn['trials']} trials): best {tn['best_params']}")
    cells = measure_all(dataclasses.replace(cfg, num_requests=args.requests), tuned, model,
                        flip, say)
    ratios = {KEYS[b]: ratio(cells["easerve"]["request_goodput"], cells[b]["request_goodput"]) for b in BASELINES}
    return {"family": FAMILIES[modality], "model": model, "probe": pr, "tune": tn,
            "tuned_deployment": tuned.to_dict(), "cells": cells, "ratios": ratios}


def table(results: dict, args) -> str:
    lines = ["| modality | server | rate req/s | SLO TTFT/TPOT ms | goodput | thru | TTFT p50 | TTFT p99 | "
             "TPOT p50 | TPOT p99 | trials | tune min |", "|" + " --- |" * 12]
    f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for mod, r in results.items():
        slo = f"{r['probe']['slo_ms'][0]:.0f}/{r['probe']['slo_ms'][1]:.1f}"
        for name, c in r["cells"].items():
            label = f"easerve ({r['tune']['best_params'].get('alloc')})" if name == "easerve" else name
            lines.append(f"| {mod} | {label} | {r['probe']['rate']} | {slo} | {f(c['request_goodput'], 2)} | "
                         f"{f(c['request_throughput'], 2)} | {f(c['median_ttft_ms'], 0)} | {f(c['p99_ttft_ms'], 0)} | "
                         f"{f(c['median_tpot_ms'])} | {f(c['p99_tpot_ms'])} | {r['tune']['trials']} | "
                         f"{r['tune']['tune_minutes']:.1f} |")
    lines.append(f"\n{args.requests} requests per cell (Poisson, seed {args.seed}, {args.output_tokens} output "
                 f"tokens, ignore_eos); rate = {args.load_factor} x dynamo-like's saturated throughput; SLO = "
                 f"{args.slo_mult} x unloaded TTFT / TPOT; measured {time.strftime('%Y-%m-%d %H:%M')}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the running stack, like Ctrl-C
    results = {}
    for i, m in enumerate(args.modalities):
        results[m] = run_modality(args, m, i % 2 == 1, say)
        (args.out_dir / f"{m}.json").write_text(json.dumps(results[m], indent=2) + "\n")  # kept if a later one fails
    text = table(results, args)
    print(text)
    (args.out_dir / "goodput.md").write_text(text + "\n")
    out = {k: {m: r["ratios"][k] for m, r in results.items()} for k in KEYS.values()}
    out["tune_minutes"] = {m: r["tune"]["tune_minutes"] for m, r in results.items()}
    out["goodput"] = {m: {n: c["request_goodput"] for n, c in r["cells"].items()} for m, r in results.items()}
    out["trials"] = args.trials
    out["rates"] = {m: r["probe"]["rate"] for m, r in results.items()}
    out["out_dir"] = str(args.out_dir)
    (args.out_dir / "goodput.json").write_text(json.dumps({"summary": out, "results": results}, indent=2) + "\n")
    print(f"saved {args.out_dir / 'goodput.md'} and goodput.json", file=sys.stderr)
    finish("goodput", args, out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
