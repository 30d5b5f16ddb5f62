"""TEMPORARY one-at-a-time stand-in for the batched PrefillLoop (being written on another branch)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from dataclasses import dataclass

from easerve.engine.sampler import sample
from easerve.types import PrefillRequest, PrefillResult


@dataclass(frozen=True)
class PrefilledOne:
    result: PrefillResult
    first_token: int
    prefill_ms: float
    batch_size: int


class PrefillLoop:
    def __init__(self, adapter, config=None, executor=None, scope=None, on_busy=None):
        self.adapter = adapter
        self._pool = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefill")
        self._scope, self._on_busy = scope or contextlib.nullcontext, on_busy

    queued = 0

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def _run(self, req):
        t0 = time.monotonic()
        with self._scope():
            res = self.adapter.prefill([req])[0]
        first = sample(res.last_logits[None], [req.sampling], [0])[0]
        t1 = time.monotonic()
        if self._on_busy:
            self._on_busy(t0, t1)
        return PrefilledOne(res, first, (t1 - t0) * 1000, 1)

    async def prefill(self, req: PrefillRequest) -> PrefilledOne:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._run, req)
