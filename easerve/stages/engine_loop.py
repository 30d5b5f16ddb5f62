"""Asyncio front of the decode engine: one engine thread, many request streams.

All engine calls (add, step, abort, stats) run on one dedicated thread, so the
engine itself needs no locks; torch releases the GIL during the forward, so the
event loop keeps serving RPCs while a step runs. Each request gets an asyncio
queue that the step thread feeds through `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator
from dataclasses import dataclass

from easerve.types import KVPayload


@dataclass
class _Stream:
    queue: asyncio.Queue
    done: bool = False


class AsyncEngine:
    def __init__(self, engine):
        self.engine = engine
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def _call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pool.shutdown(wait=True)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while await self._call(lambda: self.engine.has_work):
                outs = await self._call(self.engine.step)
                self._deliver(outs)

    def _deliver(self, outs) -> None:
        for o in outs:
            s = self._streams.get(o.request_id)
            if s is None:
                continue
            s.queue.put_nowait(o)
            if o.finished:
                s.done = True

    async def generate(self, payload: KVPayload) -> AsyncIterator:
        """Admit the request (raises the engine's Overloaded when the waiting queue is
        full) and yield its step outputs until it finishes. Closing the iterator early
        (client cancel, deadline) aborts the request and frees its KV at once."""
        rid = payload.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already decoding; ids must be unique")
        stream = _Stream(asyncio.Queue())
        self._streams[rid] = stream
        try:
            await self._call(self.engine.add, payload)
            self._wake.set()
            while True:
                out = await stream.queue.get()
                yield out
                if out.finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not stream.done:
                await asyncio.shield(self._call(self.engine.abort, rid))
                self._wake.set()

    async def reserve(self, request_id: str, prompt_len: int, max_tokens: int, ttl_s: float) -> None:
        """Hold a place before the request's prefill runs (raises the engine's Overloaded /
        RequestTooLarge at once when it could not be admitted)."""
        await self._call(self.engine.reserve, request_id, prompt_len, max_tokens, ttl_s)

    async def abort(self, request_id: str) -> bool:
        """Stop a request now (KV freed); its stream ends with finish_reason "abort"."""
        found = await self._call(self.engine.abort, request_id)
        self._wake.set()
        return found

    async def stats(self):
        return await self._call(self.engine.stats)
