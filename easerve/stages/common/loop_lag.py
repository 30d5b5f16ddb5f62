"""How late an event loop runs what is due: a ticker that asks to wake every `period_s` and
records by how much each wake-up came late (a callback holding the loop, the GIL held by another
thread, or the process not scheduled) into a Prometheus histogram (the gateway's:
`easerve:gateway_event_loop_lag_seconds`)."""
from __future__ import annotations

import asyncio
import time

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
PERIOD_S = 0.01


async def watch_lag(hist, period_s: float = PERIOD_S) -> None:
    """Run until cancelled: every `period_s`, observe (`hist.observe`) how late the wake-up was."""
    clock = time.perf_counter
    while True:
        due = clock() + period_s
        await asyncio.sleep(period_s)
        hist.observe(max(0.0, clock() - due))
