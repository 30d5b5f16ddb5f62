"""Encode batching live through the whole stack: throughput must never fall as load rises.

The `default` deployment (encode -> remote prefill -> decode, one torch thread each) on the
bench-scale Qwen2.5-VL checkpoint, one 448x336 image + ~64 prompt tokens and 64 output tokens
per request (one image costs more than the gap between arrivals), once per encode batch mode:
adaptive, continuous, request_at_a_time (B = 1, the Dynamo-like baseline) and fixed (B = 8).
The saturated capacity C is measured first on the adaptive stack (a burst of requests, all at
once: completed / wall); then every mode's stack replays the same seeded Poisson trace at each
rate in --rates (multiples of C, 0.25x to 1.5x), after a warm-up. Stacks run one at a time.

Per (mode, rate) cell: offered req/s (as realized by the trace: (n - 1) / last arrival offset),
completed req/s (completed / (last completion - first arrival)), goodput (requests meeting the SLO per second; SLO = --slo-mult x the unloaded TTFT
and TPOT of the adaptive stack), P50 / P99 TTFT, and the encode batch-size histogram (the
encode service's Prometheus metrics, before and after the cell).

Last stdout line, JSON: "throughput_monotonic" (adaptive's completed req/s never falls by more
than 5 % as the offered rate rises), "throughput_at_capacity_over_offered" (adaptive: the least
completed / offered over the rates below C; target >= 0.95), "best_batching_mode" (per rate,
by goodput), then the table.

  python bench/encode_batching.py              # full run (long: four stacks, six rates)
  python bench/encode_batching.py --quick      # smoke: tiny checkpoint, adaptive, two rates (about a minute)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness import results, scoring, stack  # noqa: E402
from bench.harness.checkpoint import checkpoint, served_name  # noqa: E402
from bench.harness.load import png_uri, replay_images, unloaded  # noqa: E402

MODES = {"adaptive": ("adaptive", 8), "continuous": ("continuous", 8),
         "request_at_a_time": ("request_at_a_time", 1), "fixed-8": ("fixed", 8)}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: bench-scale tiny qwen2.5-vl)")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny"))
    ap.add_argument("--modes", default=",".join(MODES), help=f"a subset of {','.join(MODES)}")
    ap.add_argument("--rates", default="0.25,0.5,0.75,1.0,1.25,1.5", help="multiples of the saturated capacity")
    ap.add_argument("--capacity-rps", type=float, default=None, help="use this capacity instead of measuring it")
    ap.add_argument("--requests", type=int, default=40, help="requests per cell")
    ap.add_argument("--warmup", type=int, default=20, help="warm-up requests per stack (not measured)")
    ap.add_argument("--image-size", default="448x336", help="WxH")
    ap.add_argument("--prompt-words", type=int, default=60, help="words of text per request (~64 tokens)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--slo-mult", type=float, default=4.0, help="SLO = this x the unloaded TTFT / TPOT")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny checkpoint, adaptive only, "
                    "rates 0.5 and 1.0, 6 requests a cell")
    results.add_save_flag(ap)
    a = ap.parse_args(argv)
    if a.quick:
        a.modes, a.rates, a.requests, a.warmup, a.max_tokens = "adaptive", "0.5,1.0", 6, 2, 8
    a.mode_list = [m.strip() for m in a.modes.split(",") if m.strip()]
    a.rate_mults = sorted(float(x) for x in a.rates.split(","))
    a.size = tuple(int(x) for x in a.image_size.lower().split("x"))
    if not a.mode_list or any(m not in MODES for m in a.mode_list) or "adaptive" not in a.mode_list:
        ap.error(f"--modes must be a subset of {','.join(MODES)} holding adaptive (the headline figures' mode)")
    if min(a.rate_mults) <= 0 or a.requests < 2 or len(a.size) != 2:
        ap.error("--rates must be > 0, --requests >= 2, --image-size WxH")
    return a


def unit_trace(n: int, seed: int) -> list[float]:
    """Arrival offsets (s) of a rate-1 Poisson process; divide by a rate to replay it."""
    gaps = np.random.default_rng(seed).exponential(1.0, n)
    return list(np.cumsum(gaps) - gaps[0])


# ---- stack and metrics --------------------------------------------------------------------------
def start_stack(model: str, mode: str):
    batch_mode, b = MODES[mode]
    enc = dict(batch_mode=batch_mode, max_batch=b, encoder_cache_gb=0.0)
    return stack.start(stack.deployment(model, encode=enc), metrics=True)


def batch_histogram(st) -> dict[int, float]:
    """Encode batches so far by size bucket (upper bound -> batches), from encode-0's /metrics."""
    (fam,) = [f for f in stack.metric_families(st, "encode-0") if f.name == "easerve:encode_batch_size"]
    cum = sorted((float(s.labels["le"]), s.value) for s in fam.samples if s.name.endswith("_bucket"))
    out, prev = {}, 0.0
    for le, v in cum:
        if le != float("inf"):
            out[int(le)] = v - prev
            prev = v
    return out


def summarize(recs: list, offered: float, slo: tuple[float, float], hist: dict[int, float]) -> dict:
    m = scoring.metrics(recs, slo)  # per second of first arrival to last completion
    batches = sum(hist.values())
    r = lambda v, d: round(v, d) if v is not None else None  # noqa: E731
    return {"offered_rps": round(offered, 3), "completed_rps": r(m["request_throughput"], 3),
            "goodput_rps": r(m["request_goodput"], 3), "p50_ttft_ms": r(m["median_ttft_ms"], 1),
            "p99_ttft_ms": r(m["p99_ttft_ms"], 1), "failed": m["failed"],
            "batch_hist": {str(k): int(v) for k, v in hist.items() if v},
            "mean_batch": round(sum(k * v for k, v in hist.items()) / batches, 2) if batches else None}


# ---- run ------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    args = parse_args(argv)
    wall0 = time.perf_counter()
    model = checkpoint(args.model, args.cache_dir, scale="tiny" if args.quick else "bench")
    name = served_name(model)
    n = args.requests
    images = [png_uri(args.seed * 100_000 + i, args.size) for i in range(n + 40)]
    text = " ".join(["describe"] * args.prompt_words)
    unit = unit_trace(n, args.seed)
    send = lambda url, offsets, ims: replay_images(url, name, list(zip(offsets, ims)), args.max_tokens, text)[0]  # noqa: E731
    table: dict[str, dict] = {}
    rows: list[dict] = []
    cap, slo, trace = args.capacity_rps, None, None
    for mode in ["adaptive", *[m for m in args.mode_list if m != "adaptive"]]:
        st = start_stack(model, mode)
        try:
            url = st.endpoints.http
            send(url, [0.0] * args.warmup, images[n:n + args.warmup])
            if slo is None:  # adaptive, first: the unloaded latency and the saturated capacity
                slo = scoring.unloaded_limits(unloaded(url, name, args.size, args.max_tokens, text=text),
                                              args.slo_mult)
                if cap is None:
                    cap = summarize(send(url, [0.0] * n, images[:n]), 0.0, slo, {})["completed_rps"]
                print(f"capacity {cap:.3f} req/s; SLO TTFT {slo[0]:.0f} ms, TPOT {slo[1]:.1f} ms",
                      file=sys.stderr, flush=True)
            row = table.setdefault(mode, {})
            for m in args.rate_mults:
                rate = m * cap
                before = batch_histogram(st)
                offsets = [u / rate for u in unit]
                res = send(url, offsets, images[:n])
                after = batch_histogram(st)
                cell = summarize(res, (n - 1) / offsets[-1], slo, {k: after[k] - before.get(k, 0.0) for k in after})
                row[f"{m:g}x"] = cell
                rows.append(scoring.report_row(mode, cell["offered_rps"], res, slo))
                print(f"{mode:17s} {m:4.2f}x {cell['offered_rps']:6.3f} req/s -> {cell['completed_rps']:6.3f} done, goodput "
                      f"{cell['goodput_rps']:6.3f}, TTFT p50 {cell['p50_ttft_ms']:8.1f} p99 {cell['p99_ttft_ms']:8.1f} "
                      f"ms, batches {cell['batch_hist']}", file=sys.stderr, flush=True)
            if mode == "adaptive":
                trace = json.loads(stack.get(st.endpoints.metrics["encode-0"] + "/trace"))
        finally:
            st.stop()
    out = verdict(table, args.rate_mults)
    out.update({"capacity_rps": cap, "slo_ttft_ms": round(slo[0], 1), "slo_tpot_ms": round(slo[1], 2),
                "model": name, "image": args.image_size, "requests_per_cell": n, "max_tokens": args.max_tokens,
                "quick": args.quick, "wall_s": round(time.perf_counter() - wall0, 1), "table": table})
    results.finish("encode_batching", args, out, argv, lambda: results.report_plots(rows, trace))
    return out


def verdict(table: dict[str, dict], mults: list[float]) -> dict:
    a = [table["adaptive"][f"{m:g}x"] for m in mults]
    thr = [c["completed_rps"] for c in a]
    below = [c["completed_rps"] / c["offered_rps"] for m, c in zip(mults, a) if m < 1.0]
    best = {f"{m:g}x": max(table, key=lambda mode: table[mode][f"{m:g}x"]["goodput_rps"]) for m in mults}
    return {"throughput_monotonic": all(hi >= lo * 0.95 for lo, hi in zip(thr, thr[1:])),
            "throughput_at_capacity_over_offered": round(min(below), 3) if below else None,
            "best_batching_mode": best}


if __name__ == "__main__":
    main()
