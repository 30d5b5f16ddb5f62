"""Continuous batched prefill: an asyncio front over `adapter.prefill(batch)`.

    loop = PrefillLoop(adapter, PrefillBatchConfig(max_batched_tokens=2048, max_batch_size=16),
                       executor=None, scope=None, on_busy=None, clock=MonotonicClock(), prefix=None)
    loop.start()                                   # inside the running event loop
    one = await loop.prefill(req, slo_s=None, yields=False)   # req: PrefillRequest
    one.result, one.first_tokens, one.prefill_ms, one.batch_size   # one.first_token: choice 0's
    await loop.stop()

- Batching: requests queue in a `PrefillBatcher` (FCFS under the token budget, see
  `easerve.policy.prefill_plan`; in deadline order for requests that carry `slo_s`, the
  seconds until their first token is due by their SLO tier, or `yields`), told when its
  worker is free (`on_free` after each batch). One worker task takes the next batch as soon as the previous one has finished,
  with no waiting for more arrivals: requests that arrive while a batch runs form the next
  batch.
- Compute: a batch runs in `executor` (default: one thread of its own) as ONE
  `adapter.prefill(batch)` forward, then `easerve.engine.sampler.sample` draws each
  request's first token (its own SamplingParams, step 0; with n > 1 one per choice, each
  with `SamplingParams.choice(i)` and its own grammar state); both run under `scope()` when
  given (a context manager: e.g. the co-located prefill's share of the device).
  `on_busy(t0, t1)` (seconds of `clock`) is called on the event loop after each batch;
  `loop.spans` (easerve.stages.common.call_spans) keeps each batch's span (batch size,
  prompt tokens), the prefill service's GET /trace.
- Prefix cache (`prefix`, an easerve.cache.prefix_kv.PrefixKV, or None): before the
  forward each request takes the KV of its longest cached prefix and the forward computes
  only the rest; after it, the prompts' full blocks are kept (`PrefillResult.cached_tokens`
  says how many tokens came from the cache). The batch token budget counts what a request
  leaves to compute (its prompt less its cached prefix when it arrived).
- Time: every time the loop reads (arrivals, the batcher's `now`, t0 / t1) comes from
  `clock` (an `easerve.policy.clock.Clock`; a MonotonicClock unless given).
- `PrefilledOne.prefill_ms` is the batch's compute time (forward + sampling) in ms;
  `batch_size` is how many requests that forward held.
- Failures: `adapter.check_prefill` runs for every request first; one that raises
  InvalidRequest (empty prompt, embeddings that do not fit its placeholders) fails alone and
  the rest of the batch goes on. Any other error (of a check, the forward, sampling, scope)
  fails every request of that batch with it; the loop keeps serving. A request cancelled
  while queued leaves the queue; one cancelled while its batch runs is computed and dropped.
  `stop()` fails the requests still queued with RuntimeError.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
from dataclasses import dataclass

import torch

from easerve.cache.prefix_kv import PrefixKV
from easerve.policy.clock import Clock, MonotonicClock
from easerve.policy.prefill_plan import PrefillBatchConfig, PrefillBatcher
from easerve.stages.common.call_spans import CallSpans
from easerve.stages.common.pace import Pace
from easerve.engine.logit_transforms import TokenHistory
from easerve.engine.sampler import sample
from easerve.types import PrefillRequest, PrefillResult
from easerve.errors import InvalidRequest

log = logging.getLogger("easerve.prefill")


@dataclass(frozen=True)
class PrefilledOne:
    result: PrefillResult
    first_tokens: tuple[int, ...]  # one per choice (sampling n)
    prefill_ms: float
    batch_size: int

    @property
    def first_token(self) -> int:
        return self.first_tokens[0]


@dataclass
class _Pending:
    req: PrefillRequest
    future: asyncio.Future


@dataclass
class _BatchOut:
    """What one batch run returns: per request a (result, first tokens) or its own InvalidRequest."""

    outcomes: list[tuple[PrefillResult, tuple[int, ...]] | InvalidRequest]
    t0: float
    t1: float
    forward_size: int


class PrefillLoop:
    def __init__(self, adapter, config: PrefillBatchConfig | None = None,
                 executor: concurrent.futures.Executor | None = None, scope=None, on_busy=None,
                 clock: Clock | None = None, prefix: PrefixKV | None = None):
        self.adapter = adapter
        self.prefix = prefix  # the prefix cache (None: off); used in the worker thread only
        self.clock = clock or MonotonicClock()
        self.batcher = PrefillBatcher(config or PrefillBatchConfig())
        self._own_pool = executor is None
        self._pool = executor
        self.pace = Pace()  # prompt tokens per batch and its seconds, served in Stage/Load
        self._scope, self._on_busy = scope or contextlib.nullcontext, on_busy
        self.spans = CallSpans(clock=self.clock.now)  # each batch: GET /trace's call spans
        self._pending: dict[int, _Pending] = {}
        self._running: list[_Pending] = []
        self._keys = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def config(self) -> PrefillBatchConfig:
        return self.batcher.config

    @property
    def queued(self) -> int:
        """Requests waiting for a prefill batch (not the running one)."""
        return self.batcher.pending

    @property
    def overdue(self) -> int:
        """Of those, the ones the deadline order puts last now."""
        return self.batcher.overdue(self.clock.now())

    def start(self) -> None:
        """Start the worker task (call from inside the running event loop)."""
        if self._task is not None and not self._task.done():
            raise RuntimeError("the prefill loop is already running")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefill")
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._worker(), name="prefill-loop")

    async def stop(self) -> None:
        """Stop the worker; queued and running requests fail with RuntimeError. The loop's
        own thread (not a given executor) is shut down; start() makes a new one."""
        running = list(self._running)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        err = RuntimeError("the prefill loop stopped; retry on another prefill worker")
        for p in [*self._pending.values(), *running]:
            if not p.future.done():
                p.future.set_exception(err)
        for key in list(self._pending):
            self.batcher.remove(key)
        self._pending.clear()
        self._running = []
        if self._own_pool and self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    async def prefill(self, req: PrefillRequest, slo_s: float | None = None, yields: bool = False) -> PrefilledOne:
        """Queue one request; resolves when its batch has been prefilled. `slo_s`: seconds until
        its first token is due by its SLO tier; `yields`: best-effort or batch work."""
        if self._task is None or self._task.done():
            raise RuntimeError("the prefill loop is not running; call start() first")
        key = next(self._keys)
        tokens = self.prefix.to_compute(req) if self.prefix is not None else len(req.input_ids)
        now = self.clock.now()
        self.batcher.add(key, tokens, now, None if slo_s is None else now + slo_s, yields)
        fut = asyncio.get_running_loop().create_future()
        self._pending[key] = _Pending(req, fut)
        self._wake.set()
        try:
            return await fut
        finally:
            if self._pending.pop(key, None) is not None:  # cancelled while queued
                self.batcher.remove(key)

    async def _worker(self) -> None:
        while True:
            plan = self.batcher.next_batch(self.clock.now())
            if plan is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._running = [self._pending.pop(k) for k in plan.request_ids]
            try:
                await self._run(self._running)
            finally:
                self._running = []
                self.batcher.on_free(self.clock.now())

    async def _run(self, batch: list[_Pending]) -> None:
        loop = asyncio.get_running_loop()
        try:
            out = await loop.run_in_executor(self._pool, self._run_sync, [p.req for p in batch])
        except Exception as e:  # noqa: BLE001 - every request of the batch learns why
            log.exception("prefill batch of %d failed", len(batch))
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(e)
            return
        ms = (out.t1 - out.t0) * 1000
        tokens = sum(len(p.req.input_ids) for p in batch)
        self.pace.observe(out.t1 - out.t0, tokens)
        self.spans.record("prefill", out.t0, out.t1, len(batch), tokens=tokens)
        for p, o in zip(batch, out.outcomes):
            if p.future.done():
                continue
            if isinstance(o, InvalidRequest):
                p.future.set_exception(o)
            else:
                p.future.set_result(PrefilledOne(o[0], o[1], ms, out.forward_size))
        if self._on_busy is not None:
            try:
                self._on_busy(out.t0, out.t1)
            except Exception:  # noqa: BLE001 - a tracing hook must never stop prefill
                log.exception("prefill on_busy hook failed")

    def _run_sync(self, reqs: list[PrefillRequest]) -> _BatchOut:
        """Executor thread: check each request, one forward for the good ones, first tokens."""
        t0 = self.clock.now()
        outcomes: list = [None] * len(reqs)
        good, histories = [], []
        for i, r in enumerate(reqs):
            try:
                self.adapter.check_prefill(r)
                histories.append([TokenHistory.start(r.sampling.choice(c), r.sampling.prompt_ids(r.input_ids),
                                                     self.adapter.eos_token_ids,
                                                     self.adapter) for c in range(r.sampling.n)])
            except InvalidRequest as e:
                outcomes[i] = e
            else:
                good.append(i)
        if good:
            batch = [reqs[i] for i in good]
            looks = [self.prefix.lookup(r) for r in batch] if self.prefix is not None else []
            try:
                with self._scope():
                    results = (self.adapter.prefill(batch, [lk.prefix for lk in looks]) if looks
                               else self.adapter.prefill(batch))
                    for lk, res in zip(looks, results):
                        self.prefix.store(lk, res)
                    rows = [j for j, r in enumerate(batch) for _ in range(r.sampling.n)]  # a row per choice
                    logits = torch.stack([results[j].last_logits for j in rows])
                    firsts = sample(logits, [r.sampling.choice(c) for r in batch for c in range(r.sampling.n)],
                                    [len(batch[j].sampling.resumed) for j in rows], [h for hs in histories for h in hs])
            finally:
                for lk in looks:
                    self.prefix.release(lk)
            at = 0
            for i, r, res in zip(good, batch, results):
                outcomes[i] = (res, tuple(int(t) for t in firsts[at:at + r.sampling.n]))
                at += r.sampling.n
        return _BatchOut(outcomes, t0, self.clock.now(), len(good))
