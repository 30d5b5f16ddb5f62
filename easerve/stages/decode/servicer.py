"""easerve.v1.Decode <-> the async engine front (thin).

Open holds the reservation and streams the request's tokens after the first (prefill sent
that one) straight to the gateway, at most one message per `--stream-interval-ms`
(stream_interval.py); Submit takes the KV prefill hands over. While the stage drains
(easerve.rpc.drain), new reservations (Open) are refused UNAVAILABLE, but Submit is still taken
(`DRAIN_ALLOWS`) for the reservations held, whose streams the drain waits for: removing a
decode instance under load loses no accepted request.
"""
from __future__ import annotations

import time

from easerve.wire.protoconv import token_chunk
from easerve.rpc.deadline import Deadline
from easerve.rpc.errors import grpc_errors
from easerve.errors import InvalidRequest
from easerve.stages.decode.stream_interval import Coalescer
from easerve.types import MAX_N
from easerve.wire.v1 import common_pb2 as cpb
from easerve.wire.v1 import decode_pb2, decode_pb2_grpc

MAX_HOLD_S = 600.0  # a reservation lapses at the request's deadline, at the latest after this
# while draining: the KV (and cancels) of the reservations already held still come in
DRAIN_ALLOWS = ("/easerve.v1.Decode/Submit", "/easerve.v1.Decode/Cancel", "/easerve.v1.Decode/Stats")


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine, kv_receiver, max_waiting: int, metrics=None, stream_interval_ms: float = 0.0):
        """`stream_interval_ms`: send a stream's tokens at most this often (stream_interval.py)."""
        self.engine, self.kv, self.max_waiting, self.m = engine, kv_receiver, max_waiting, metrics
        self.stream_interval_s = stream_interval_ms / 1000
        Coalescer(self.stream_interval_s, time.monotonic)  # a bad interval fails here, at start
        self._kv_ms: dict[str, float] = {}

    @grpc_errors
    async def Open(self, request, context):
        rid = request.meta.request_id
        if not rid:
            raise InvalidRequest("meta.request_id is required")
        if request.num_tokens < 1 or request.max_new_tokens < 1:
            raise InvalidRequest(f"a reservation needs num_tokens >= 1 (the prompt) and max_new_tokens >= 1, got "
                                 f"{request.num_tokens} and {request.max_new_tokens}")
        if request.n > MAX_N:
            raise InvalidRequest(f"n must be in 1..{MAX_N} (choices per request), got {request.n}")
        deadline = Deadline.from_context(context, request.meta.deadline_ms)
        ttl = min(deadline.remaining(), MAX_HOLD_S)
        async with self.engine.open(rid, request.num_tokens, request.max_new_tokens, ttl, request.n or 1) as stream:
            yield cpb.TokenChunk(request_id=rid)  # the place is held
            counts: dict[int, int] = {}  # tokens per choice
            pending = Coalescer(self.stream_interval_s, time.monotonic)
            try:
                async for o in stream:
                    if o.index == 0 and not o.finished:
                        continue  # prefill sent the first token and its text
                    ids = [o.token_id] if o.token_id is not None and o.index > 0 else []
                    lps = [o.logprobs] if ids and o.logprobs is not None else []
                    n = counts[o.choice] = max(counts.get(o.choice, 1), o.index + 1)
                    for h in pending.add(o.choice, ids, o.text_delta, lps, o.finished):
                        if not h.finished:
                            yield token_chunk(rid, h.ids, text=h.text, logprobs=h.logprobs, index=h.choice)
                            continue
                        if self.m is not None:
                            self.m.finished.labels(finished_reason=o.finish_reason).inc()
                        yield token_chunk(rid, h.ids, o.finish_reason, text=h.text, usage=(request.num_tokens, n),
                                          logprobs=h.logprobs, index=h.choice, kv_transfer_ms=self._kv_ms.get(rid, 0.0))
            finally:
                self._kv_ms.pop(rid, None)

    @grpc_errors
    async def Submit(self, request, context):
        t0 = time.monotonic()
        deadline = Deadline.from_context(context, request.meta.deadline_ms)
        payload = await self.kv.fetch(request.kv, timeout=deadline.timeout())
        if payload.request_id != request.meta.request_id:
            raise InvalidRequest(f"KV payload is for {payload.request_id!r}, the call for "
                                 f"{request.meta.request_id!r}")
        await self.engine.submit(payload)
        ms = (time.monotonic() - t0) * 1000
        self._kv_ms[payload.request_id] = ms
        if self.m is not None:
            where = request.kv.WhichOneof("location")
            self.m.kv_receive.labels(transport=where).observe(ms / 1000)
            self.m.kv_receive_bytes.labels(transport=where).inc(
                sum(t.numel() * t.element_size() for t in [*payload.keys, *payload.values]))
        return decode_pb2.SubmitResponse(kv_transfer_ms=ms)

    @grpc_errors
    async def Stats(self, request, context):
        s = await self.engine.stats()
        return decode_pb2.StatsResponse(running=s.running, waiting=s.waiting, max_waiting=self.max_waiting,
                                        kv_free_tokens=s.kv_free_tokens, kv_total_tokens=s.kv_capacity_tokens,
                                        kv_free_bytes=int(s.kv_bytes * s.kv_free_tokens / max(1, s.kv_capacity_tokens)),
                                        reserved=self.engine.num_streams)

    @grpc_errors
    async def Cancel(self, request, context):
        return decode_pb2.CancelResponse(found=await self.engine.abort(request.request_id))
