"""The encode worker's micro-batching loop around the pure AdaptiveBatcher.

Requests are the unit of batching: a dispatch encodes every media item of its
requests in one `adapter.encode` call. One worker task runs batches one after
another and, between them, waits for the batcher's next gap/cap deadline or an
arrival. The batcher hands out a batch only while the encoder is free (a Dispatch
marks it busy, `on_free` after the batch ends): arrivals during a batch accumulate
and leave together, up to B, when it finishes. Nothing waits in a queue of decided
batches behind the running one.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass

from easerve.policy.batcher import AdaptiveBatcher, Dispatch
from easerve.policy.clock import Clock, MonotonicClock
from easerve.stages.common.pace import Pace
from easerve.types import MMItem

log = logging.getLogger("easerve.encode")


@dataclass
class _Pending:
    items: list[MMItem]
    future: asyncio.Future
    arrived: float  # clock.now() at arrival


@dataclass(frozen=True)
class EncodeResult:
    embeddings: list
    queue_ms: float
    encode_ms: float
    batch_size: int


def _fail(batch: dict[str, _Pending], e: BaseException) -> None:
    for p in batch.values():
        if not p.future.done():
            p.future.set_exception(e)


class EncodeLoop:
    def __init__(self, adapter, batcher: AdaptiveBatcher, controller=None, metrics=None,
                 executor: concurrent.futures.Executor | None = None, clock: Clock | None = None):
        """`clock`: where every time the loop reads comes from (arrivals, the batcher's `now`,
        queue and encode times); a MonotonicClock unless given."""
        self.adapter, self.batcher, self.controller, self.m = adapter, batcher, controller, metrics
        self.clock = clock or MonotonicClock()
        self._pool = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="encode")
        self._pending: dict[str, _Pending] = {}
        self._ready: Dispatch | None = None  # handed out by `add`, for the worker to run next
        self._arrival = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.pace = Pace()  # requests per batch and its seconds, served in Stage/Load

    @property
    def queued(self) -> int:
        """Requests waiting for a batch or in the running one."""
        return len(self._pending)

    @property
    def overdue(self) -> int:
        """Of the waiting ones, those the batcher's deadline order puts last now."""
        return self.batcher.overdue(self.clock.now())

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def encode(self, request_id: str, items: list[MMItem], slo_s: float | None = None,
                     yields: bool = False) -> EncodeResult:
        """Queue one request's items; resolves when its batch has been encoded. `slo_s`: seconds
        until its first token is due by its SLO tier; `yields`: best-effort or batch work (the
        batcher's deadline order)."""
        dead = [t for t in self._tasks if t.done()]
        if not self._tasks or dead:
            raise RuntimeError("the encode loop is not running; restart this encode worker")
        fut = asyncio.get_running_loop().create_future()
        now = self.clock.now()
        self._pending[request_id] = _Pending(items, fut, now)
        d = self.batcher.add(request_id, now, None if slo_s is None else now + slo_s, yields)
        if d is not None:  # the encoder was free: the batcher is now busy until the worker runs it
            self._ready = d
        self._arrival.set()
        try:
            return await fut
        finally:
            if self._pending.pop(request_id, None) is not None:  # cancelled while queued
                self.batcher.remove(request_id)

    async def _next(self) -> Dispatch:
        """The next batch: one `add` handed out, or the first the batcher has due."""
        while True:
            if (d := self._ready) is not None:
                self._ready = None
                return d
            now = self.clock.now()
            if (d := self.batcher.poll(now)) is not None:
                return d
            due = self.batcher.next_deadline(now)
            self._arrival.clear()
            timeout = None if due is None else max(0.0, due - now)
            try:
                await asyncio.wait_for(self._arrival.wait(), timeout)
            except TimeoutError:
                pass

    async def _worker(self) -> None:
        while True:
            d = await self._next()
            batch = {rid: self._pending.pop(rid) for rid in d.item_ids if rid in self._pending}
            try:
                if batch:
                    await self._run(d, batch)
            except Exception as e:  # noqa: BLE001 - never let one batch stop the worker
                log.exception("encode batch failed")
                _fail(batch, e)
            finally:
                self.batcher.on_free(self.clock.now())

    async def _run(self, d: Dispatch, batch: dict[str, _Pending]) -> None:
        items = [it for p in batch.values() for it in p.items]
        t0 = self.clock.now()
        if self.m is not None:
            try:
                self.m.on_batch_start(t0)
            except Exception:  # noqa: BLE001 - metrics must never stall encoding
                log.exception("encode metrics hook failed")
        try:
            embeds = await asyncio.get_running_loop().run_in_executor(self._pool, self._encode_sync, items, len(batch))
        except Exception as e:  # noqa: BLE001 - every request of the batch learns why
            _fail(batch, e)
            if self.m is not None:
                self.m.on_batch_failed(t0, self.clock.now())
            return
        t1 = self.clock.now()
        self.pace.observe(t1 - t0, len(batch))
        i = 0
        for p in batch.values():
            n = len(p.items)
            if not p.future.done():
                p.future.set_result(EncodeResult(embeds[i:i + n], (t0 - p.arrived) * 1000, (t1 - t0) * 1000,
                                                 len(batch)))
            i += n
        self._observe(d, batch, t0, t1)

    def _observe(self, d: Dispatch, batch: dict[str, _Pending], t0: float, t1: float) -> None:
        if self.m is None:
            return
        try:
            share = self.controller.last.encode_share if self.controller and self.controller.last else 1.0
            self.m.on_batch(d, len(batch), t0, t1, share)
            for p in batch.values():
                self.m.on_queue_wait(t0 - p.arrived)
        except Exception:  # noqa: BLE001 - metrics must never stall encoding
            log.exception("encode metrics hook failed")

    def _encode_sync(self, items: list[MMItem], batch_size: int):
        if self.controller is None:
            return self.adapter.encode(items)
        with self.controller.encode_scope(batch_size):
            return self.adapter.encode(items)
