"""Encode micro-batching policies on one seeded Poisson trace: request-at-a-time, fixed B, adaptive B.

The real encode loop (easerve.stages.encode.loop.EncodeLoop: asyncio timer + worker, the
adapter's `encode` in its one executor thread) runs a bench-scale checkpoint with one torch
thread. First the batch-1 and batch-B encode times are measured; the arrival rates are then
multiples of the batch-1 capacity (default 0.3x, 0.9x, 2x; the highest is clamped to
--max-load of the batch-B capacity so that batching can still keep up). At every rate the SAME
trace (one seeded unit-rate Poisson trace, scaled by 1/rate) of pre-processed requests is
replayed against each policy, each on a fresh batcher and loop.

Per rate x policy: throughput (completed requests / (last completion - first arrival)),
P50/P99 queue wait (EncodeResult.queue_ms: arrival to the start of its batch's encode), mean
batch size (requests / batches), P99 total (queue_ms + encode_ms).

"adaptive_never_worse_than_both": at every rate, adaptive's throughput is >= that of at least
one baseline AND its P99 queue wait is <= that of at least one baseline (the two baselines may
differ per metric). Comparisons allow --tol relative slack (and 1 ms on waits), because an
arrival-limited throughput differs between policies only by run-to-run noise on a shared CPU;
"adaptive_never_worse_than_both_strict" is the same check with no slack.
Each run also reports encode_slowdown: its encode time over the isolated measurement (a
shared CPU: rows well above 1 ran while other work competed and are not comparable).
A finite trace ends with a partial batch: fixed B waits the safety cap for it, which is in
fixed's span (so in its throughput), as it would be for a real burst that ends.
Last stdout line: one JSON object, headline ratios first, then the booleans, then the table.

  python bench/encode_batching.py                          # tiny bench-scale qwen2.5-vl, 56x56 images
  python bench/encode_batching.py --family llava-next      # another tiny family (audio ones use --audio-s)
  python bench/encode_batching.py --model DIR              # any checkpoint easerve can load
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("request_at_a_time", "fixed", "adaptive")
SHORT = {"request_at_a_time": "rat", "fixed": "fixed", "adaptive": "adaptive"}
RATE_NAMES = ("low", "mid", "high")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="qwen2.5-vl", help="tiny bench-scale family to build (ignored with --model)")
    ap.add_argument("--model", help="checkpoint folder (loaded with role='encode')")
    ap.add_argument("--cache-dir", default=str(ROOT / "runs" / "tiny-bench"),
                    help="where the bench-scale checkpoint is built once (cached_tiny)")
    ap.add_argument("--image-size", type=int, default=56, help="square image side for image families (px)")
    ap.add_argument("--audio-s", type=float, default=1.0, help="clip length for audio families (s)")
    ap.add_argument("--n", type=int, default=100, help="requests per (rate, policy) run")
    ap.add_argument("--rates", default="0.3,0.9,2.0",
                    help="low,mid,high arrival rates as multiples of the measured batch-1 capacity")
    ap.add_argument("--max-load", type=float, default=0.8,
                    help="clamp every rate to this fraction of the measured batch-B capacity")
    ap.add_argument("--batch1-ms", type=float, default=None,
                    help="use this batch-1 encode time instead of measuring it (pins the rates)")
    ap.add_argument("--batchB-ms", type=float, default=None, help="same for a batch of --max-batch")
    ap.add_argument("--max-batch", type=int, default=8, help="B for fixed and adaptive")
    ap.add_argument("--max-gap-ms", type=float, default=50.0,
                    help="adaptive gap-threshold ceiling (the encode service's --max-gap-s default)")
    ap.add_argument("--gap-coef", type=float, default=2.0)
    ap.add_argument("--safety-cap-s", type=float, default=1.0)
    ap.add_argument("--tol", type=float, default=0.02, help="relative slack of the never-worse check")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (also in the encode thread)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.rate_mults = [float(x) for x in args.rates.split(",")]
    if len(args.rate_mults) != 3 or min(args.rate_mults) <= 0:
        ap.error("--rates takes three positive multiples: low,mid,high")
    if args.n < 2 or args.max_batch < 1 or args.max_gap_ms <= 0:
        ap.error("--n must be >= 2, --max-batch >= 1, --max-gap-ms > 0")
    return args


# ---- model and requests ------------------------------------------------------------------
def load(args):
    from easerve.models.registry import load_adapter
    if args.model:
        path = Path(args.model)
    else:
        from easerve.models.tiny import cached_tiny
        path = cached_tiny(args.family, args.cache_dir, seed=0, scale="bench")
    return load_adapter(path, role="encode")


def make_requests(adapter, n: int, args) -> list[list]:
    """n pre-processed requests (one media item each): the MMItems EncodeLoop.encode takes."""
    rng = np.random.default_rng(args.seed)
    out = []
    for _ in range(n):
        if "image" in adapter.modalities:
            from PIL import Image
            px = rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8)
            part = {"type": "image", "image": Image.fromarray(px)}
        else:
            sr = adapter.sampling_rate
            part = {"type": "audio", "audio": (0.1 * rng.standard_normal(int(sr * args.audio_s))).astype(np.float32)}
        prompt = adapter.preprocess([{"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}])
        out.append(list(prompt.items))
    return out


def time_encode(adapter, reqs: list[list], batch: int, reps: int) -> float:
    """Fastest of `reps` adapter.encode calls over `batch` requests, after one warm-up call:
    on a shared CPU the minimum is the least disturbed estimate of the encoder's own speed."""
    items = [it for r in reqs[:batch] for it in r]
    adapter.encode(items)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        adapter.encode(items)
        ts.append(time.perf_counter() - t0)
    return min(ts)


def unit_trace(n: int, seed: int) -> list[float]:
    """Arrival offsets (s) of a rate-1 Poisson process; divide by the rate to replay it."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(1.0)
    return out


# ---- one run -----------------------------------------------------------------------------
class BatchLog:
    """The `metrics` hook EncodeLoop calls per batch; only dispatch reasons are read from it
    (batch sizes come from the EncodeResults), and any other hook it calls is a no-op."""

    def __init__(self) -> None:
        self.reasons: dict[str, int] = {}

    def on_batch(self, d, *_rest) -> None:
        self.reasons[d.reason] = self.reasons.get(d.reason, 0) + 1

    def __getattr__(self, name: str):
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


def batcher_config(policy: str, args):
    from easerve.policy.batcher import BatcherConfig
    return BatcherConfig(max_batch=args.max_batch, mode=policy, safety_cap_s=args.safety_cap_s,
                         gap_coef=args.gap_coef, max_gap_s=min(args.max_gap_ms / 1000, args.safety_cap_s))


async def replay(adapter, reqs: list[list], offsets: list[float], policy: str, args, expect) -> dict:
    """One run of the trace; `expect(k)` = isolated encode seconds of a batch of k (for the
    slowdown column: in-run encode time over isolated, > 1 when the shared CPU was busy)."""
    from easerve.policy.batcher import AdaptiveBatcher
    from easerve.stages.encode.loop import EncodeLoop
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="encode",
                                                 initializer=torch.set_num_threads, initargs=(args.threads,))
    log = BatchLog()
    loop = EncodeLoop(adapter, AdaptiveBatcher(batcher_config(policy, args)), metrics=log, executor=pool)
    loop.start()
    done: list[float] = [0.0] * len(offsets)
    late: list[float] = [0.0] * len(offsets)

    async def one(i: int):
        res = await loop.encode(f"r{i}", reqs[i])
        done[i] = time.monotonic()
        return res

    try:
        t0 = time.monotonic() + 0.05
        tasks = []
        for i, off in enumerate(offsets):
            delay = t0 + off - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            late[i] = time.monotonic() - (t0 + off)
            tasks.append(asyncio.create_task(one(i)))
        await _watch(loop, tasks)
        results = [t.result() for t in tasks]
    finally:
        await loop.stop()
        pool.shutdown(wait=True)
    first_arrival = t0 + offsets[0] + late[0]
    span = max(done) - first_arrival
    wait = np.array([r.queue_ms for r in results])
    total = np.array([r.queue_ms + r.encode_ms for r in results])
    batches = sum(1 / r.batch_size for r in results)  # a batch of k: k results that say k
    return {
        "throughput_rps": round(len(results) / span, 3),
        "p50_wait_ms": round(float(np.percentile(wait, 50)), 2),
        "p99_wait_ms": round(float(np.percentile(wait, 99)), 2),
        "mean_batch": round(len(results) / batches, 2),
        "p99_total_ms": round(float(np.percentile(total, 99)), 2),
        "mean_encode_ms": round(statistics.fmean(r.encode_ms for r in results), 2),
        "batches": round(batches),
        "encode_slowdown": round(sum(r.encode_ms / 1000 / expect(r.batch_size) / r.batch_size for r in results)
                                 / batches, 2),
        "reasons": dict(sorted(log.reasons.items())),
        "span_s": round(span, 3),
        "max_arrival_late_ms": round(max(late) * 1000, 2),
    }


async def _watch(loop, tasks: list[asyncio.Task]) -> None:
    """Wait for every request; fail loudly if one of the loop's own tasks died (a dead
    worker or timer leaves the requests pending forever)."""
    pending = set(tasks)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=1.0)
        for t in getattr(loop, "_tasks", ()):
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise RuntimeError(f"EncodeLoop task died: {t.exception()!r}") from t.exception()
    for t in tasks:
        t.result()  # re-raise a request's encode error


# ---- verdict and output ------------------------------------------------------------------
def never_worse(row: dict, tol: float) -> tuple[bool, bool]:
    """(throughput ok, p99 wait ok): adaptive at least as good as at least one baseline."""
    a, bases = row["adaptive"], [row["request_at_a_time"], row["fixed"]]
    thr = any(a["throughput_rps"] >= b["throughput_rps"] * (1 - tol) for b in bases)
    wait = any(a["p99_wait_ms"] <= b["p99_wait_ms"] * (1 + tol) + (1.0 if tol > 0 else 0.0) for b in bases)
    return thr, wait


def ratio(a: float, b: float) -> float | None:
    return None if b <= 1e-9 else round(a / b, 3)


def main(argv=None) -> dict:
    args = parse_args(argv)
    wall0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    adapter = load(args)
    params = sum(p.numel() for p in adapter.parameters())
    media = f"{args.image_size}x{args.image_size} image" if "image" in adapter.modalities else f"{args.audio_s}s audio"
    print(f"model: {type(adapter).__name__} encode role, {params / 1e6:.1f} M params, one {media} per request, "
          f"{args.threads} torch thread(s)", flush=True)
    reqs = make_requests(adapter, args.n, args)
    B = args.max_batch
    t1 = time_encode(adapter, reqs, 1, reps=10)
    tB = time_encode(adapter, reqs, min(B, args.n), reps=6)
    if args.batch1_ms or args.batchB_ms:
        print(f"measured: batch 1 {t1 * 1e3:.1f} ms, batch {B} {tB * 1e3:.1f} ms (overridden)", flush=True)
        t1 = args.batch1_ms / 1000 if args.batch1_ms else t1
        tB = args.batchB_ms / 1000 if args.batchB_ms else tB
    cap1, capB = 1 / t1, min(B, args.n) / tB
    print(f"encode: batch 1 {t1 * 1e3:.1f} ms ({cap1:.1f} req/s), batch {B} {tB * 1e3:.1f} ms ({capB:.1f} req/s)",
          flush=True)
    kB = min(B, args.n)

    def expect(k: int) -> float:  # linear between the two measured batch sizes
        return t1 if kB == 1 else t1 + (tB - t1) * (min(k, kB) - 1) / (kB - 1)

    rates, clamped = [], []
    for m in args.rate_mults:
        r = m * cap1
        clamped.append(r > args.max_load * capB)
        rates.append(min(r, args.max_load * capB))
    unit = unit_trace(args.n, args.seed)

    table: dict[str, dict] = {}
    for name, rate, was_clamped in zip(RATE_NAMES, rates, clamped):
        offsets = [u / rate for u in unit]
        row: dict = {"rate_rps": round(rate, 3), "x_batch1_capacity": round(rate / cap1, 3),
                     "x_batchB_capacity": round(rate / capB, 3), "clamped": was_clamped}
        for policy in POLICIES:
            res = asyncio.run(replay(adapter, reqs, offsets, policy, args, expect))
            row[policy] = res
            print(f"{name:4s} {rate:6.2f} req/s  {policy:17s} thr {res['throughput_rps']:6.2f} req/s  "
                  f"wait p50 {res['p50_wait_ms']:7.1f} p99 {res['p99_wait_ms']:7.1f} ms  "
                  f"batch {res['mean_batch']:4.2f}  total p99 {res['p99_total_ms']:7.1f} ms  "
                  f"slowdown {res['encode_slowdown']:4.2f}  {res['reasons']}", flush=True)
        thr_ok, wait_ok = never_worse(row, args.tol)
        s_thr, s_wait = never_worse(row, 0.0)
        row["adaptive_ok"] = {"throughput": thr_ok, "p99_wait": wait_ok,
                              "throughput_strict": s_thr, "p99_wait_strict": s_wait}
        table[name] = row

    result: dict = {}
    for name in ("high", "mid", "low"):
        row = table[name]
        a = row["adaptive"]
        for base in ("request_at_a_time", "fixed"):
            b = row[base]
            result[f"adaptive_over_{SHORT[base]}_throughput_{name}"] = ratio(a["throughput_rps"], b["throughput_rps"])
            result[f"adaptive_over_{SHORT[base]}_p99_wait_{name}"] = ratio(a["p99_wait_ms"], b["p99_wait_ms"])
    result["adaptive_never_worse_than_both"] = all(
        table[n]["adaptive_ok"]["throughput"] and table[n]["adaptive_ok"]["p99_wait"] for n in RATE_NAMES)
    result["adaptive_never_worse_than_both_strict"] = all(
        table[n]["adaptive_ok"]["throughput_strict"] and table[n]["adaptive_ok"]["p99_wait_strict"]
        for n in RATE_NAMES)
    result.update({
        "tol": args.tol,
        "batch1_encode_ms": round(t1 * 1e3, 2), f"batch{B}_encode_ms": round(tB * 1e3, 2),
        "batch1_capacity_rps": round(cap1, 2), f"batch{B}_capacity_rps": round(capB, 2),
        "max_batch": B, "max_gap_ms": args.max_gap_ms, "gap_coef": args.gap_coef,
        "safety_cap_s": args.safety_cap_s, "n": args.n, "params_m": round(params / 1e6, 1),
        "media": media, "threads": args.threads, "seed": args.seed,
        "wall_s": round(time.perf_counter() - wall0, 1),
        "table": table,
    })
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
