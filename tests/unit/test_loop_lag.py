"""The event-loop lag ticker: a callback that holds the loop shows as a late wake-up."""
from __future__ import annotations

import asyncio
import time

from easerve.stages.common.loop_lag import watch_lag
from easerve.stages.gateway.metrics import GatewayMetrics


def _bucket(hist, le: float) -> float:
    for m in hist.collect():
        for s in m.samples:
            if s.name.endswith("_bucket") and s.labels["le"] == str(le):
                return s.value
    raise KeyError(le)


def test_a_blocked_loop_is_observed_as_lag():
    hist = GatewayMetrics().loop_lag

    async def main():
        task = asyncio.ensure_future(watch_lag(hist, period_s=0.005))
        await asyncio.sleep(0.05)
        time.sleep(0.12)  # holds the loop: the ticker wakes >= 0.1 s late once
        await asyncio.sleep(0.05)
        task.cancel()
    asyncio.run(main())
    total = next(s.value for m in hist.collect() for s in m.samples if s.name.endswith("_count"))
    assert total >= 5
    assert total - _bucket(hist, 0.1) == 1  # exactly the one wake-up after the block was > 100 ms late
