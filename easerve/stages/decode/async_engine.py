"""Asyncio front of the decode engine: one engine thread, many request streams.

All engine calls (reserve, add, step, abort, stats) run on one dedicated thread, so the
engine itself needs no locks; torch releases the GIL during the forward, so the event
loop keeps serving RPCs while a step runs. A request's life here:

    async with engine.open(rid, prompt_len, max_tokens, ttl_s) as stream:  # the reservation
        ...                         # prefill runs elsewhere, then calls engine.submit(payload)
        async for out in stream:    # StepOutputs until the request finishes
            ...

Leaving the `open` block early (client cancel, deadline) aborts the request: its
reservation or its KV is freed at once. If a step raises, every open stream fails with
`EngineFailed` and `on_fatal(error)` is told (the service turns NOT_SERVING): nothing
waits for a deadline on a dead engine.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from easerve.errors import EngineFailed, InvalidRequest, NotFound
from easerve.stages.common.call_spans import CallSpans
from easerve.stages.common.pace import Pace
from easerve.types import KVPayload

log = logging.getLogger(__name__)


class _Stream:
    """A request's outputs; it ends once each of its n choices has finished."""

    def __init__(self, n: int = 1) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.submitted = False
        self.done = False
        self.left = n  # choices not finished yet

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.done and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.left -= 1
            self.done = self.left <= 0
        return item


class AsyncEngine:
    def __init__(self, engine, on_fatal: Callable[[BaseException], None] | None = None,
                 on_step: Callable[[int, float], None] | None = None):
        """`on_fatal(error)`: a step raised; `on_step(tokens, seconds)`: after each step."""
        self.engine, self.on_fatal, self.on_step = engine, on_fatal, on_step
        self.pace = Pace()  # sequences per step and its seconds, served in Stage/Load
        self.spans = CallSpans()  # each step (batch, mean context): the decode service's GET /trace
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.failed: BaseException | None = None

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pool.shutdown(wait=True)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def _run(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                more = True
                while more:
                    t0 = time.monotonic()
                    outs, more = await self._call(self._step)
                    t1 = time.monotonic()
                    if outs is None:  # no work after all
                        break
                    self.pace.observe(t1 - t0, len(outs))
                    batch, context = getattr(self.engine, "last_step", (0, 0))
                    if batch:
                        self.spans.record("decode", t0, t1, batch, context=context)
                    if self.on_step is not None:
                        self.on_step(sum(o.token_id is not None and o.index > 0 for o in outs), time.monotonic() - t0)
                    self._deliver(outs)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every stream learns why, then health goes NOT_SERVING
            log.exception("decode step failed; failing %d open requests", len(self._streams))
            self._fail_all(e)

    def _step(self) -> tuple[list | None, bool]:
        """On the engine thread: a step's outputs (None: no work) and whether there is work after
        it (one hand-over to the thread per step, not two)."""
        if not self.engine.has_work:
            return None, False
        outs = self.engine.step()
        return outs, self.engine.has_work

    def _fail_all(self, e: BaseException) -> None:
        self.failed = e
        err = EngineFailed(f"decode engine failed ({type(e).__name__}: {e}); retry on another instance")
        for s in self._streams.values():
            s.queue.put_nowait(err)
        if self.on_fatal is not None:
            self.on_fatal(e)

    def _deliver(self, outs) -> None:
        for o in outs:
            s = self._streams.get(o.request_id)
            if s is not None:
                s.queue.put_nowait(o)

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise EngineFailed(f"decode engine failed earlier ({type(self.failed).__name__}); "
                               "this instance takes no new requests")

    @contextlib.asynccontextmanager
    async def open(self, request_id: str, prompt_len: int, max_tokens: int, ttl_s: float,
                   n: int = 1) -> AsyncIterator[_Stream]:
        """Hold a place for n choices (raises the engine's Overloaded / RequestTooLarge at once
        when it could not be admitted) and yield the stream the request's outputs arrive on."""
        self._check_alive()
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already open here; ids must be unique")
        stream = _Stream(n)
        await self._call(self.engine.reserve, request_id, prompt_len, max_tokens, ttl_s, n)
        self._streams[request_id] = stream
        try:
            yield stream
        finally:
            self._streams.pop(request_id, None)
            if not stream.done:
                await asyncio.shield(self._call(self.engine.abort, request_id))
                self._wake.set()

    async def submit(self, payload: KVPayload) -> None:
        """Hand over a reserved request's prefilled KV; its outputs go to its open stream."""
        self._check_alive()
        stream = self._streams.get(payload.request_id)
        if stream is None:
            raise NotFound(f"request {payload.request_id!r} holds no reservation here (cancelled, "
                           "lapsed, or sent to the wrong decode instance)")
        if stream.submitted:
            raise InvalidRequest(f"request {payload.request_id!r} was already submitted")
        stream.submitted = True
        await self._call(self.engine.add, payload)
        self._wake.set()

    async def abort(self, request_id: str) -> bool:
        """Stop a request now (KV freed); its stream ends with finish_reason "abort"."""
        found = await self._call(self.engine.abort, request_id)
        self._wake.set()
        return found

    async def stats(self):
        return await self._call(self.engine.stats)

    async def generate(self, payload: KVPayload) -> AsyncIterator:
        """Reserve, submit and stream in one go (warm-up and in-process use)."""
        ttl = 600.0
        async with self.open(payload.request_id, payload.prompt_len, payload.sampling.max_tokens, ttl,
                             payload.sampling.n) as s:
            await self.submit(payload)
            async for out in s:
                yield out
