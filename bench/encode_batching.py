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
import asyncio
import base64
import io
import json
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.encoder_cache import one  # noqa: E402  (the same streamed request)

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


# ---- requests ------------------------------------------------------------------------------------
def png_uri(seed: int, size: tuple[int, int]) -> str:
    from PIL import Image
    arr = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def unit_trace(n: int, seed: int) -> list[float]:
    """Arrival offsets (s) of a rate-1 Poisson process; divide by a rate to replay it."""
    gaps = np.random.default_rng(seed).exponential(1.0, n)
    return list(np.cumsum(gaps) - gaps[0])


async def replay(url: str, model: str, offsets: list[float], images: list[str], args) -> list[dict]:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
    text = " ".join(["describe"] * args.prompt_words)
    t0 = time.perf_counter() + 0.05

    async def at(off: float, image: str) -> dict:
        await asyncio.sleep(max(0.0, t0 + off - time.perf_counter()))
        try:
            return await one(client, model, image, args.max_tokens, text)
        except Exception as e:  # noqa: BLE001 - a failed request counts as failed
            return {"error": f"{type(e).__name__}: {e}"}

    out = await asyncio.gather(*(at(o, im) for o, im in zip(offsets, images)))
    await client.close()
    return list(out)


# ---- stack and metrics --------------------------------------------------------------------------
def start_stack(model: str, mode: str):
    from hasctl.deployment import preset
    from hasctl.launch import Stack, free_port
    batch_mode, b = MODES[mode]
    d = preset("default").with_model(model).with_gateway_ports(0, 0).with_flags(
        "encode", batch_mode=batch_mode, max_batch=b, encoder_cache_gb=0.0, threads=1,
        metrics_listen=f"127.0.0.1:{free_port()}").with_flags("prefill", threads=1).with_flags("decode", threads=1)
    stack = Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"})
    stack.start(timeout=600)
    return stack


def batch_histogram(stack) -> dict[int, float]:
    """Encode batches so far by size bucket (upper bound -> batches), from encode-0's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    argv = stack._procs["encode-0"].cmd.argv
    text = urllib.request.urlopen(f"http://{argv[argv.index('--metrics-listen') + 1]}/metrics", timeout=10).read()
    (fam,) = [f for f in text_string_to_metric_families(text.decode()) if f.name == "easerve:encode_batch_size"]
    cum = sorted((float(s.labels["le"]), s.value) for s in fam.samples if s.name.endswith("_bucket"))
    out, prev = {}, 0.0
    for le, v in cum:
        if le != float("inf"):
            out[int(le)] = v - prev
            prev = v
    return out


def summarize(results: list[dict], offered: float, slo: tuple[float, float], hist: dict[int, float]) -> dict:
    done = [r for r in results if "error" not in r]
    ttft = np.array([r["ttft"] for r in done] or [float("inf")])
    span = max(r["end"] for r in done) - min(r["t0"] for r in done) if done else float("inf")
    good = sum(r["ttft"] <= slo[0] and r["tpot"] <= slo[1] for r in done)
    batches = sum(hist.values())
    return {"offered_rps": round(offered, 3), "completed_rps": round(len(done) / span, 3),
            "goodput_rps": round(good / span, 3), "p50_ttft_ms": round(float(np.percentile(ttft, 50)) * 1e3, 1),
            "p99_ttft_ms": round(float(np.percentile(ttft, 99)) * 1e3, 1), "failed": len(results) - len(done),
            "batch_hist": {str(k): int(v) for k, v in hist.items() if v},
            "mean_batch": round(sum(k * v for k, v in hist.items()) / batches, 2) if batches else None}


# ---- run ------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    args = parse_args(argv)
    wall0 = time.perf_counter()
    from easerve.models.tiny import cached_tiny
    model = args.model or str(cached_tiny("qwen2.5-vl", args.cache_dir, scale="tiny" if args.quick else "bench"))
    name = Path(model).resolve().name
    n = args.requests
    images = [png_uri(args.seed * 100_000 + i, args.size) for i in range(n + 40)]
    unit = unit_trace(n, args.seed)
    table: dict[str, dict] = {}
    cap = args.capacity_rps
    slo = None
    for mode in ["adaptive", *[m for m in args.mode_list if m != "adaptive"]]:
        stack = start_stack(model, mode)
        try:
            url = stack.endpoints.http
            asyncio.run(replay(url, name, [0.0] * args.warmup, images[n:n + args.warmup], args))
            if slo is None:  # adaptive, first: the unloaded latency and the saturated capacity
                seq = [asyncio.run(replay(url, name, [0.0], [images[n + 30 + k]], args))[0] for k in range(3)]
                slo = (args.slo_mult * float(np.median([r["ttft"] for r in seq])),
                       args.slo_mult * max(float(np.median([r["tpot"] for r in seq])), 1e-3))
                if cap is None:
                    burst = asyncio.run(replay(url, name, [0.0] * n, images[:n], args))
                    cap = summarize(burst, 0.0, slo, {})["completed_rps"]
                print(f"capacity {cap:.3f} req/s; SLO TTFT {slo[0] * 1e3:.0f} ms, TPOT {slo[1] * 1e3:.1f} ms",
                      file=sys.stderr, flush=True)
            row = table.setdefault(mode, {})
            for m in args.rate_mults:
                rate = m * cap
                before = batch_histogram(stack)
                offsets = [u / rate for u in unit]
                res = asyncio.run(replay(url, name, offsets, images[:n], args))
                after = batch_histogram(stack)
                cell = summarize(res, (n - 1) / offsets[-1], slo, {k: after[k] - before.get(k, 0.0) for k in after})
                row[f"{m:g}x"] = cell
                print(f"{mode:17s} {m:4.2f}x {cell['offered_rps']:6.3f} req/s -> {cell['completed_rps']:6.3f} done, goodput "
                      f"{cell['goodput_rps']:6.3f}, TTFT p50 {cell['p50_ttft_ms']:8.1f} p99 {cell['p99_ttft_ms']:8.1f} "
                      f"ms, batches {cell['batch_hist']}", file=sys.stderr, flush=True)
        finally:
            stack.stop()
    out = verdict(table, args.rate_mults)
    out.update({"capacity_rps": cap, "slo_ttft_ms": round(slo[0] * 1e3, 1), "slo_tpot_ms": round(slo[1] * 1e3, 2),
                "model": name, "image": args.image_size, "requests_per_cell": n, "max_tokens": args.max_tokens,
                "quick": args.quick, "wall_s": round(time.perf_counter() - wall0, 1), "table": table})
    print(json.dumps(out))
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
