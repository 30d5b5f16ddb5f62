"""Prefill as a stage: build the KV, sample the first token and send it up at once,
hand the KV to a decode worker and relay its token stream.

Used by the prefill service and by the encode service's co-located prefill, so a
local and a remote prefill behave exactly alike downstream.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import AsyncIterator

import grpc

from easerve.engine.sampler import sample
from easerve.rpc.deadline import Deadline
from easerve.rpc.errors import from_rpc_error
from easerve.stages.convert import token_chunk
from easerve.stages.limits import InflightLimit
from easerve.stages.peers import Peers, relay
from easerve.types import KVPayload, PrefillRequest
from easerve.v1 import common_pb2 as cpb
from easerve.v1 import decode_pb2, decode_pb2_grpc


class PrefillStage:
    def __init__(self, adapter, decode_addrs: tuple[str, ...], kv_sender, channel_options=(),
                 executor: concurrent.futures.Executor | None = None, scope=None, on_busy=None,
                 max_inflight: int = 512):
        """`scope()`: context the forward runs in (the co-located share of the device);
        `on_busy(start, end)`: told of each prefill's busy span (utilization trace)."""
        if not decode_addrs:
            raise ValueError("prefill needs at least one --decode address")
        self.adapter, self.kv = adapter, kv_sender
        self._decode = Peers(decode_pb2_grpc.DecodeStub, decode_addrs, channel_options)
        self._pool = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefill")
        self._eos = frozenset(adapter.eos_token_ids)
        self._scope, self._on_busy = scope or contextlib.nullcontext, on_busy
        self.limit = InflightLimit(max_inflight, "prefill")

    def _prefill_sync(self, req: PrefillRequest):
        t0 = time.monotonic()
        with self._scope():
            res = self.adapter.prefill([req])[0]
        first = sample(res.last_logits[None], [req.sampling], [0])[0]
        if self._on_busy is not None:
            self._on_busy(t0, time.monotonic())
        return res, first

    def _finished_at_first(self, req: PrefillRequest, first: int) -> str | None:
        sp = req.sampling
        if first in sp.stop_token_ids or (not sp.ignore_eos and first in self._eos):
            return "stop"
        return "length" if sp.max_tokens <= 1 else None

    async def run(self, req: PrefillRequest, deadline: Deadline, **timings: float) -> AsyncIterator[cpb.TokenChunk]:
        """Yield the first-token chunk, then decode's chunks until the request finishes."""
        with self.limit.admit():
            async for chunk in self._run(req, deadline, **timings):
                yield chunk

    async def _run(self, req: PrefillRequest, deadline: Deadline, **timings: float) -> AsyncIterator[cpb.TokenChunk]:
        decode = self._decode.next()
        await self._reserve(decode, req, deadline)  # a full decode refuses before any compute
        handed_over = False
        try:
            t0 = time.monotonic()
            res, first = await asyncio.get_running_loop().run_in_executor(self._pool, self._prefill_sync, req)
            deadline.check("prefill")
            prefill_ms = (time.monotonic() - t0) * 1000
            done = self._finished_at_first(req, first)
            usage = (res.prompt_len, 1) if done else None
            yield token_chunk(req.request_id, [first], done, usage=usage, prefill_ms=prefill_ms, **timings)
            if done:
                return
            payload = KVPayload(req.request_id, res.keys, res.values, res.prompt_len, res.rope_delta, first,
                                req.sampling, prompt_ids_tail=list(req.input_ids[-8:]))
            handed_over = True
            async for chunk in self._decode_call(decode, payload, deadline):
                yield chunk
        finally:
            if not handed_over:
                await self._release(decode, req.request_id)

    async def _reserve(self, decode, req: PrefillRequest, deadline: Deadline) -> None:
        msg = decode_pb2.ReserveRequest(meta=cpb.RequestMeta(request_id=req.request_id, deadline_ms=deadline.to_ms()),
                                        num_tokens=len(req.input_ids), max_new_tokens=req.sampling.max_tokens)
        try:
            await decode.Reserve(msg, timeout=deadline.timeout())
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None

    @staticmethod
    async def _release(decode, request_id: str) -> None:
        """Give an unused reservation back (best effort: it lapses at the deadline anyway)."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await asyncio.shield(decode.Cancel(decode_pb2.CancelRequest(request_id=request_id), timeout=5))

    async def _decode_call(self, decode, payload: KVPayload, deadline: Deadline) -> AsyncIterator[cpb.TokenChunk]:
        handle = await self.kv.send(payload)
        meta = cpb.RequestMeta(request_id=payload.request_id, deadline_ms=deadline.to_ms())
        msg = decode_pb2.DecodeRequest(meta=meta, kv=handle, num_tokens=payload.prompt_len,
                                       max_new_tokens=payload.sampling.max_tokens)
        try:
            async for chunk in relay(decode.Decode(msg, timeout=deadline.timeout())):
                yield chunk
        finally:
            self.kv.release(handle)
