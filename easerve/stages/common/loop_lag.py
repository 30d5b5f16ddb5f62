"""How late the event loop runs what is due: a ticker that asks to wake every `period_s` and
records by how much each wake-up came late (a callback holding the loop, the GIL held by another
thread, or the process not scheduled), into a Prometheus histogram."""
from __future__ import annotations

import asyncio
import time

from prometheus_client import Histogram

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def lag_histogram(registry, stage: str) -> Histogram:
    return Histogram(f"easerve:{stage}_event_loop_lag_seconds",
                     f"How late the {stage}'s event loop woke a {int(PERIOD_S * 1e3)} ms ticker (its p99 under "
                     "load is the delay any request or /health call can meet there)",
                     buckets=LAG_BUCKETS, registry=registry)


PERIOD_S = 0.01


async def watch_lag(hist: Histogram, period_s: float = PERIOD_S) -> None:
    """Run until cancelled: every `period_s`, observe how late the wake-up was."""
    clock = time.perf_counter
    while True:
        due = clock() + period_s
        await asyncio.sleep(period_s)
        hist.observe(max(0.0, clock() - due))
