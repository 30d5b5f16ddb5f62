"""Cost of the encode control plane per request, and the router's precision vs random.

Replays Poisson arrivals through AdaptiveBatcher (polling at every deadline, like the asyncio
loop), routes each dispatched request with DeficitRouter and partitions each micro-batch with
SMPartitioner. decision_us = control-plane microseconds per request (target <= 20).
Last stdout line: one JSON object, decision_us first.
    python bench/control_plane.py [--n 100000] [--rate 200] [--s 0.3]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from easerve.policy.batcher import AdaptiveBatcher, BatcherConfig
from easerve.policy.partitioner import SMPartitioner, measure_grid
from easerve.policy.router import DeficitRouter, RandomRouter, max_prefix_error

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness.results import add_save_flag, finish  # noqa: E402


def arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def replay(times: list[float], batcher: AdaptiveBatcher, router, part: SMPartitioner) -> tuple[float, list, int]:
    """Seconds spent in the control plane, the routes, and the number of batches."""
    routes: list[str] = []
    batches = 0

    def run(d) -> None:  # a worker that finishes each batch at once (decisions only are timed)
        nonlocal batches
        batches += 1
        batcher.on_free(d.at)
        part.choose(d.size)
        for _ in d.item_ids:
            routes.append(router.route())

    t0 = time.perf_counter()
    for i, t in enumerate(times):
        while (dl := batcher.next_deadline(t)) is not None and dl <= t:
            while (d := batcher.poll(dl)) is not None:
                run(d)
        if (d := batcher.add(i, t)) is not None:
            run(d)
    end = times[-1] + 10.0
    while (d := batcher.poll(end)) is not None:
        run(d)
    return time.perf_counter() - t0, routes, batches


def per_call_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--rate", type=float, default=200.0, help="arrivals per second")
    ap.add_argument("--s", type=float, default=0.3, help="remote prefill fraction")
    ap.add_argument("--max-batch", type=int, default=8)
    add_save_flag(ap)
    a = ap.parse_args()

    times = arrivals(a.n, a.rate)
    part = SMPartitioner(measure_grid(lambda b, s: 0.01 * b / min(1.0, s / min(1.0, 0.15 * b)), [1, 2, 4, 8]))
    cfg = BatcherConfig(max_batch=a.max_batch)
    secs, det_routes, batches = replay(times, AdaptiveBatcher(cfg), DeficitRouter(a.s), part)
    rnd_secs, rnd_routes, _ = replay(times, AdaptiveBatcher(cfg), RandomRouter(a.s, seed=0), part)
    det_err, rnd_err = max_prefix_error(det_routes, a.s), max_prefix_error(rnd_routes, a.s)
    det, rnd = DeficitRouter(a.s), RandomRouter(a.s, seed=1)
    result = {
        "decision_us": round(secs / a.n * 1e6, 3),
        "router_error_ratio_random_vs_deficit": round(rnd_err / max(det_err, 1e-9), 1),
        "deficit_max_prefix_error": round(det_err, 4),
        "random_max_prefix_error": round(rnd_err, 2),
        "decision_us_with_random_router": round(rnd_secs / a.n * 1e6, 3),
        "deficit_route_us": round(per_call_us(det.route, a.n), 3),
        "random_route_us": round(per_call_us(rnd.route, a.n), 3),
        "choose_us": round(per_call_us(lambda: part.choose(5), a.n), 3),
        "mean_batch": round(a.n / batches, 2),
        "requests": a.n, "rate": a.rate, "s": a.s, "max_batch": a.max_batch,
    }
    print(f"control plane: {result['decision_us']} us/request (target <= 20), mean batch "
          f"{result['mean_batch']}, router max prefix error {det_err:.3f} (random {rnd_err:.1f})")
    finish("control_plane", a, result)


if __name__ == "__main__":
    main()
