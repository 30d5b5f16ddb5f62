"""The gateway's domain logic, shared by its gRPC and HTTP fronts.

A request is preprocessed here (chat template, tokenization, the HF processor on decoded
media) and given an internal id of the gateway's own. Then, for each request:

1. a decode instance is picked by load and asked to hold a place (`Decode.Open`: refused
   at once when decode is full, before any compute); that call is also the stream the
   request's tokens after the first come back on, straight from decode;
2. an encode instance (media) or a prefill instance (text only) is picked by load and
   told which decode instance holds the place; its call returns the first token and ends
   once the KV is at decode;
3. the first token goes out at once, then decode's tokens. The stop rules and the text are
   decided downstream (prefill for the first token, decode after it): the gateway forwards.

Leaving early (client gone, deadline) cancels both calls, which frees every stage's work.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from easerve.media import MediaResolver, config_for
from easerve.protoconv import FINISH_FROM_PROTO, media_item_to_proto, sampling_to_proto
from easerve.rpc.deadline import Deadline
from easerve.rpc.errors import Unavailable, from_rpc_error
from easerve.rpc.server import ServerOptions
from easerve.stages.cli import default_max_len
from easerve.stages.configs import GatewayConfig
from easerve.stages.limits import InflightLimit
from easerve.stages.peers import Peers
from easerve.types import ProcessedPrompt, SamplingParams
from easerve.v1 import common_pb2 as cpb
from easerve.v1 import decode_pb2, decode_pb2_grpc, encode_pb2, encode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.gateway.openai_api import BadRequest

__all__ = ["GatewayConfig", "GatewayCore", "Job", "Delta"]


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: dict = field(default_factory=dict)


@dataclass
class Job:
    """One request as the gateway sees it: chat messages or a raw prompt + media.
    `request_id` is what the client sees; `internal_id`, unique, is what the stages see."""

    sampling: SamplingParams
    request_id: str
    messages: list[dict] | None = None
    prompt: str | None = None
    media: list[dict] = field(default_factory=list)
    prompt_ids: list[int] | None = None  # a token-id prompt (/v1/completions), no media
    timeout_s: float | None = None
    received: float = field(default_factory=time.monotonic)
    internal_id: str = field(default_factory=lambda: f"gw-{uuid.uuid4().hex}")


class GatewayCore:
    def __init__(self, cfg: GatewayConfig, adapter, metrics, media: MediaResolver | None = None):
        self.cfg, self.adapter, self.m = cfg, adapter, metrics
        self.media = media or MediaResolver(config_for(adapter))  # fetches and decodes a Job's MediaRefs
        self.started = int(time.time())
        self.limit = InflightLimit(cfg.max_inflight, "the gateway")
        self.max_model_len = cfg.max_model_len or default_max_len(adapter.text_config)
        self._pool = concurrent.futures.ThreadPoolExecutor(cfg.preprocess_threads, thread_name_prefix="preprocess")
        opts = ServerOptions().channel_options()
        self._enc = Peers(encode_pb2_grpc.EncodeStub, cfg.encode, opts, service="easerve.v1.Encode")
        self._pre = Peers(prefill_pb2_grpc.PrefillStub, cfg.prefill, opts, service="easerve.v1.Prefill")
        self._dec = Peers(decode_pb2_grpc.DecodeStub, cfg.decode, opts, service="easerve.v1.Decode")

    def start(self) -> None:
        for peers in (self._enc, self._pre, self._dec):
            peers.start()

    async def stop(self) -> None:
        for peers in (self._enc, self._pre, self._dec):
            await peers.close()

    # ---- preprocessing ------------------------------------------------------------------
    def _preprocess_sync(self, job: Job) -> ProcessedPrompt:
        if job.messages is not None:
            return self.adapter.preprocess(job.messages)
        if job.prompt_ids is not None:
            return ProcessedPrompt(input_ids=list(job.prompt_ids))
        by_kind = {k: [m[k] for m in job.media if k in m] for k in ("image", "video", "audio")}
        return self.adapter.preprocess_prompt(job.prompt or "", images=by_kind["image"],
                                              videos=by_kind["video"], audios=by_kind["audio"])

    async def preprocess(self, job: Job) -> ProcessedPrompt:
        try:
            await self.media.resolve_messages(job.messages or [])
            await self.media.resolve_parts(job.media)
            prompt = await asyncio.get_running_loop().run_in_executor(self._pool, self._preprocess_sync, job)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        n, limit = len(prompt.input_ids), self.max_model_len
        if n >= limit:
            raise BadRequest(f"the prompt has {n} tokens but this model's context length (max_model_len) "
                             f"is {limit}; shorten the prompt to under {limit} tokens")
        if n + job.sampling.max_tokens > limit:
            raise BadRequest(f"prompt ({n} tokens) + max_tokens ({job.sampling.max_tokens}) exceeds the "
                             f"context length (max_model_len) {limit}; lower max_tokens to at most "
                             f"{limit - n} or shorten the prompt")
        return prompt

    # ---- downstream ---------------------------------------------------------------------
    def _deadline(self, job: Job) -> Deadline:
        budget = job.timeout_s or self.cfg.request_timeout_s
        left = budget - (time.monotonic() - job.received)
        if left <= 0:
            raise TimeoutError(f"request {job.request_id} ran out of its {budget:.1f} s deadline")
        return Deadline.after(left)

    def _meta(self, job: Job, deadline: Deadline) -> cpb.RequestMeta:
        return cpb.RequestMeta(request_id=job.internal_id, deadline_ms=deadline.to_ms(), model=self.cfg.served_model)

    async def _upstream(self, job: Job, prompt: ProcessedPrompt, deadline: Deadline, decode_addr: str):
        """(peers, open_call) of the stage that computes the first token."""
        meta, sp = self._meta(job, deadline), sampling_to_proto(job.sampling)
        target = cpb.DecodeTarget(address=decode_addr)
        if prompt.items:
            if not self._enc:
                raise BadRequest("this deployment has no encode stage; send text only")
            items = await asyncio.get_running_loop().run_in_executor(  # pixel copies: off the loop
                self._pool, lambda: [media_item_to_proto(it) for it in prompt.items])
            req = encode_pb2.EncodeRequest(meta=meta, input_ids=prompt.input_ids, sampling=sp, decode=target,
                                           items=items)
            return self._enc, lambda p: p.stub.Encode(req, timeout=deadline.timeout())
        req = prefill_pb2.PrefillRequest(meta=meta, input_ids=prompt.input_ids, sampling=sp, decode=target)
        return self._pre, lambda p: p.stub.Prefill(req, timeout=deadline.timeout())

    async def generate(self, job: Job) -> AsyncIterator[Delta]:
        """Yield text deltas; the last one carries finish_reason and usage."""
        with self.limit.admit():
            async for d in self._generate(job):
                yield d

    async def _generate(self, job: Job) -> AsyncIterator[Delta]:
        self.m.requests_running.inc()
        self.m.requests_waiting.inc()
        waiting = True
        try:
            prompt = await self.preprocess(job)
            async for d in self._stream(job, prompt):
                if waiting:
                    waiting = False
                    self.m.requests_waiting.dec()
                yield d
        finally:
            self.m.requests_running.dec()
            if waiting:
                self.m.requests_waiting.dec()

    async def _stream(self, job: Job, prompt: ProcessedPrompt) -> AsyncIterator[Delta]:
        deadline = self._deadline(job)
        reserve = decode_pb2.ReserveRequest(meta=self._meta(job, deadline), num_tokens=len(prompt.input_ids),
                                            max_new_tokens=job.sampling.max_tokens)
        dpeer, dcall, _ack = await self._dec.start_call(lambda p: p.stub.Open(reserve, timeout=deadline.timeout()))
        upeers = upeer = ucall = tail = None
        try:
            upeers, open_up = await self._upstream(job, prompt, deadline, dpeer.addr)
            upeer, ucall, first = await upeers.start_call(open_up, prefer=dpeer.addr)
            delta = self._first(job, prompt, first)
            yield delta
            if delta.finish_reason is not None:
                return
            tail = asyncio.ensure_future(_drain(ucall))
            async for d in self._decoded(job, prompt, dcall, tail):
                yield d
        finally:
            dcall.cancel()
            if ucall is not None:
                ucall.cancel()
            if tail is not None and not tail.done():
                tail.cancel()
            if upeer is not None:
                upeers.finish(upeer)
            self._dec.finish(dpeer)

    def _first(self, job: Job, prompt: ProcessedPrompt, chunk) -> Delta:
        ttft = time.monotonic() - job.received
        self.m.ttft.observe(ttft)
        t = chunk.timings
        for stage, ms in (("encode", t.encode_ms), ("prefill", t.prefill_ms), ("queue", t.queue_ms),
                          ("embed_transfer", t.embed_transfer_ms)):
            if ms > 0:
                self.m.stage_latency.observe(ms / 1000.0, stage=stage)
        timings = {"ttft_ms": ttft * 1000, "encode_ms": t.encode_ms, "queue_ms": t.queue_ms,
                   "prefill_ms": t.prefill_ms, "embed_transfer_ms": t.embed_transfer_ms}
        finish = FINISH_FROM_PROTO[chunk.finish_reason]
        if finish is not None:
            return self._last(job, prompt, list(chunk.token_ids), chunk.text, finish, 1, None, timings)
        return Delta(list(chunk.token_ids), chunk.text, timings=timings)

    async def _decoded(self, job: Job, prompt: ProcessedPrompt, dcall, tail: asyncio.Future) -> AsyncIterator[Delta]:
        """Decode's chunks, failing at once if the upstream call (the KV handoff) fails."""
        first_at, n = time.monotonic(), 1
        while True:
            read = asyncio.ensure_future(dcall.read())
            waits = {read} if tail.done() else {read, tail}
            try:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:
                read.cancel()
                raise
            if tail in done and tail.exception() is not None:
                read.cancel()
                raise tail.exception()
            if read not in done:
                done, _ = await asyncio.wait({read})
            try:
                chunk = read.result()
            except grpc.aio.AioRpcError as e:
                raise from_rpc_error(e) from None
            if chunk is grpc.aio.EOF:
                raise Unavailable("decode closed the stream before the request finished")
            n += len(chunk.token_ids)
            finish = FINISH_FROM_PROTO[chunk.finish_reason]
            if finish is not None:
                yield self._last(job, prompt, list(chunk.token_ids), chunk.text, finish, n, first_at,
                                 {"kv_transfer_ms": chunk.timings.kv_transfer_ms})
                return
            yield Delta(list(chunk.token_ids), chunk.text)

    def _last(self, job, prompt, ids, text, finish, n, first_at, timings) -> Delta:
        now = time.monotonic()
        tpot = (now - first_at) / (n - 1) if first_at is not None and n > 1 else 0.0
        if n > 1:
            self.m.tpot.observe(tpot)
        self.m.e2e.observe(now - job.received)
        self.m.finished.inc(finished_reason=finish)
        self.m.prompt_tokens.inc(len(prompt.input_ids))
        self.m.generation_tokens.inc(n)
        return Delta(ids, text, finish, len(prompt.input_ids), n, {**timings, "tpot_ms": tpot * 1000})


async def _drain(call) -> None:
    """Wait for the end of a call whose useful message was already read (the handoff's
    success); its failure becomes the matching domain error."""
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as e:
        raise from_rpc_error(e) from None
