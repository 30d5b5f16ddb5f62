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
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from easerve.encoder_cache import HolderMap, is_cache_miss
from easerve.engine.logprobs import TokenLogprobs
from easerve.errors import NotFound
from easerve.media import MediaRef, MediaResolver, config_for
from easerve.media.resolve import KINDS
from easerve.media_hash import assign_by_modality, media_hash, processor_fingerprint
from easerve.protoconv import FINISH_FROM_PROTO, media_item_to_proto, sampling_to_proto
from easerve.rpc.deadline import Deadline
from easerve.rpc.errors import Unavailable, from_rpc_error
from easerve.rpc.server import ServerOptions
from easerve.stages.cli import default_max_len
from easerve.stages.configs import GatewayConfig
from easerve.stages.limits import InflightLimit
from easerve.stages.peers import peers_of
from easerve.types import ProcessedPrompt, SamplingParams
from easerve.v1 import common_pb2 as cpb
from easerve.v1 import decode_pb2, decode_pb2_grpc, encode_pb2, encode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.gateway.openai_api import BadRequest

__all__ = ["GatewayConfig", "GatewayCore", "Job", "Delta"]
log = logging.getLogger("easerve.gateway")


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: dict = field(default_factory=dict)
    logprobs: list = field(default_factory=list)  # TokenLogprobs per token id, when asked for


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
        so = ServerOptions.of(cfg)
        opts, tls = so.channel_options(), so.tls
        self._enc = peers_of(cfg, "encode", encode_pb2_grpc.EncodeStub, opts, "easerve.v1.Encode", tls=tls)
        self._pre = peers_of(cfg, "prefill", prefill_pb2_grpc.PrefillStub, opts, "easerve.v1.Prefill", tls=tls)
        self._dec = peers_of(cfg, "decode", decode_pb2_grpc.DecodeStub, opts, "easerve.v1.Decode", tls=tls)
        self._holders = HolderMap(cfg.media_hash_entries) if cfg.media_hash_entries else None
        self._fingerprint = processor_fingerprint(adapter.processor, self.media.cfg, adapter.family) \
            if self._holders is not None else b""

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
        slots = _media_slots(job) if self._holders is not None else []
        # MediaError and the adapter's InvalidRequests are the client's (400); any other error is ours (500)
        await self.media.resolve_messages(job.messages or [])
        await self.media.resolve_parts(job.media)
        prompt = await asyncio.get_running_loop().run_in_executor(self._pool, self._preprocess_sync, job)
        n, limit = len(prompt.input_ids), self.max_model_len
        if n >= limit:
            raise BadRequest(f"the prompt has {n} tokens but this model's context length (max_model_len) "
                             f"is {limit}; shorten the prompt to under {limit} tokens")
        if n + job.sampling.max_tokens > limit:
            raise BadRequest(f"prompt ({n} tokens) + max_tokens ({job.sampling.max_tokens}) exceeds the "
                             f"context length (max_model_len) {limit}; lower max_tokens to at most "
                             f"{limit - n} or shorten the prompt")
        if slots and prompt.items:  # after the 400s: a media type it cannot hash is a bug here, not bad input
            await asyncio.get_running_loop().run_in_executor(self._pool, self._hash_items, slots, prompt)
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
        """(peers, peer, call, first message) of the stage that computes the first token."""
        meta, sp = self._meta(job, deadline), sampling_to_proto(job.sampling)
        target = cpb.DecodeTarget(address=decode_addr)
        if prompt.items:
            if not self._enc:
                raise BadRequest("this deployment has no encode stage; send text only")
            return (self._enc, *await self._encode_call(prompt, deadline, decode_addr,
                                                        dict(meta=meta, input_ids=prompt.input_ids, sampling=sp,
                                                             decode=target)))
        req = prefill_pb2.PrefillRequest(meta=meta, input_ids=prompt.input_ids, sampling=sp, decode=target)
        return (self._pre, *await self._pre.start_call(lambda p: p.stub.Prefill(req, timeout=deadline.timeout()),
                                                       prefer=decode_addr))

    # ---- encoder cache: hashes, probe, pixel-free items ----------------------------------------
    async def _encode_call(self, prompt: ProcessedPrompt, deadline: Deadline, decode_addr: str, fields: dict):
        """Open the encode call on the instance that holds (or is encoding) the request's media
        when its load allows, else on the least-loaded one; note it as the media's holder at
        once, so concurrent requests for the same media meet in one encode. Items the instance
        says it holds go without their pixels; if it no longer holds one when the request
        comes, the request is resent with every item's pixels."""
        hashes = [it.content_hash for it in prompt.items]
        target, known = self._placement(hashes, decode_addr)
        held = await self._probe(target, hashes, deadline) if known else [False] * len(hashes)
        if any(held):
            req = await self._encode_request(prompt, fields, held)
            try:
                return await self._started(hashes, req, deadline, target)
            except NotFound as e:
                if not is_cache_miss(e):
                    raise
                self._holders.forget(hashes, target)
        req = await self._encode_request(prompt, fields, [False] * len(hashes))
        return await self._started(hashes, req, deadline, target or decode_addr)

    def _placement(self, hashes: list[bytes], decode_addr: str) -> tuple[str | None, bool]:
        """(the encode instance to prefer for these media, or None to leave it to `Peers`;
        whether this gateway sent it any of them before: only then is it worth a probe)."""
        if self._holders is None or not any(hashes):
            return None, False
        keys = [h for h in hashes if h]
        addr = self._holders.holder(keys)
        if decode_addr in self._enc.addrs:  # a monolith: encode where the reservation is
            self._holders.note(keys, decode_addr)
            return decode_addr, addr == decode_addr
        peer = self._enc.get(addr) if addr else None
        known = peer is not None and self._affine(peer)
        if not known:
            try:
                peer = self._enc.pick()
            except Unavailable:
                return None, False  # start_call waits for an instance, or says none is up
        self._holders.note(keys, peer.addr)
        return peer.addr, known

    async def _encode_request(self, prompt: ProcessedPrompt, fields: dict, held: list[bool]):
        items = await asyncio.get_running_loop().run_in_executor(  # pixel copies: off the loop
            self._pool, lambda: [media_item_to_proto(it, with_inputs=not h) for it, h in zip(prompt.items, held)])
        return encode_pb2.EncodeRequest(items=items, **fields)

    async def _started(self, hashes: list[bytes], req, deadline: Deadline, prefer: str | None):
        peer, call, first = await self._enc.start_call(lambda p: p.stub.Encode(req, timeout=deadline.timeout()),
                                                       prefer=prefer)
        if self._holders is not None and peer.addr != prefer:
            self._holders.note([h for h in hashes if h], peer.addr)
        return peer, call, first

    async def _probe(self, addr: str | None, hashes: list[bytes], deadline: Deadline) -> list[bool]:
        """Which items the encode instance `addr` holds now (all False when not asked)."""
        none = [False] * len(hashes)
        peer = self._enc.get(addr) if addr else None
        if peer is None:
            return none
        try:
            resp = await peer.stub.Holds(encode_pb2.HoldsRequest(content_hashes=hashes),
                                         timeout=min(1.0, deadline.timeout() or 1.0))
        except grpc.aio.AioRpcError as e:  # an old or busy encode: send pixels, nothing lost
            log.debug("encoder cache probe of %s failed: %s", addr, e.code().name)
            return none
        return list(resp.held) if len(resp.held) == len(hashes) else none

    def _affine(self, peer) -> bool:
        """Whether `peer` is up and has at most `encoder_cache_affinity` more calls open (from
        this gateway) than the least-loaded instance that is up."""
        if not peer.up:
            return False
        least = min(q.outstanding for q in map(self._enc.get, self._enc.addrs) if q.up)
        return peer.outstanding <= least + self.cfg.encoder_cache_affinity

    def _hash_items(self, slots: list[tuple[str, dict, object]], prompt: ProcessedPrompt) -> None:
        """Set each item's content hash from the media parts it came from (see easerve.media_hash)."""
        pairs = []
        for kind, part, ref in slots:
            raw = getattr(ref, "source", None)
            value = raw if isinstance(raw, (bytes, bytearray, str, list, np.ndarray)) else part[kind]
            settings = {"fps": getattr(ref, "fps", None), "sample_rate": getattr(ref, "sample_rate", None),
                        "part_fps": part.get("fps")}
            pairs.append((kind, media_hash(self._fingerprint, kind, value, settings)))
        hashes = assign_by_modality(pairs, [it.modality for it in prompt.items])
        for it, h in zip(prompt.items, hashes or ()):
            it.content_hash = h

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
            upeers, upeer, ucall, first = await self._upstream(job, prompt, deadline, dpeer.addr)
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
                   "prefill_ms": t.prefill_ms, "embed_transfer_ms": t.embed_transfer_ms,
                   "encode_cache_hits": t.encode_cache_hits}
        finish = FINISH_FROM_PROTO[chunk.finish_reason]
        if finish is not None:
            return self._last(job, prompt, chunk, finish, 1, None, timings)
        return Delta(list(chunk.token_ids), chunk.text, timings=timings, logprobs=_logprobs(chunk))

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
                yield self._last(job, prompt, chunk, finish, n, first_at, {"kv_transfer_ms": chunk.timings.kv_transfer_ms})
                return
            yield Delta(list(chunk.token_ids), chunk.text, logprobs=_logprobs(chunk))

    def _last(self, job, prompt, chunk, finish, n, first_at, timings) -> Delta:
        now = time.monotonic()
        tpot = (now - first_at) / (n - 1) if first_at is not None and n > 1 else 0.0
        if n > 1:
            self.m.tpot.observe(tpot)
        self.m.e2e.observe(now - job.received)
        self.m.finished.inc(finished_reason=finish)
        self.m.prompt_tokens.inc(len(prompt.input_ids))
        self.m.generation_tokens.inc(n)
        return Delta(list(chunk.token_ids), chunk.text, finish, len(prompt.input_ids), n,
                     {**timings, "tpot_ms": tpot * 1000}, _logprobs(chunk))


def _logprobs(chunk) -> list[TokenLogprobs]:
    return [TokenLogprobs.from_proto(m) for m in chunk.logprobs]


def _media_slots(job: Job) -> list[tuple[str, dict, object]]:
    """(kind, part, the part's MediaRef or None) of every media part of a job, in request
    order, taken before resolving replaces the refs by decoded media."""
    parts = [p for m in (job.messages or []) if isinstance(m.get("content"), list) for p in m["content"]]
    parts += list(job.media)
    out = []
    for p in parts:
        kind = p.get("type")
        if kind in KINDS and kind in p:
            ref = p[kind]
            out.append((kind, p, ref if isinstance(ref, MediaRef) else None))
    return out


async def _drain(call) -> None:
    """Wait for the end of a call whose useful message was already read (the handoff's
    success); its failure becomes the matching domain error."""
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as e:
        raise from_rpc_error(e) from None
