"""The gateway's domain logic, shared by its gRPC and HTTP fronts.

A request is preprocessed here (chat template, tokenization, the HF processor on decoded
media; or, when the encoder cache holds all its media, from the chat template alone: see
easerve.cache.gateway) and given an internal id of the gateway's own. Then, for each request:

1. a decode instance is picked by load and asked to hold a place (`Decode.Open`: refused
   at once when decode is full, before any compute); that call is also the stream the
   request's tokens after the first come back on, straight from decode;
2. an encode instance (media) or a prefill instance (text only) is picked by load and
   told which decode instance holds the place; its call returns the first token and ends
   once the KV is at decode;
3. the first token goes out at once, then decode's tokens. The stop rules and the text are
   decided downstream (prefill for the first token, decode after it): the gateway forwards.
   A request with n > 1 choices takes the same path once (`choices.fan_in`).
4. a decode stream that fails (its instance died) or sends no token for
   --decode-progress-timeout-s (stalled) migrates, up to --migration-limit times: steps 1-2
   again on other instances, the prompt followed by the tokens already sent
   (`SamplingParams.resumed`: the stages replay them, so a seeded request draws on as if
   uninterrupted and the text goes on where it stopped), and the stream resumes from there.

Leaving early (client gone, deadline) cancels both calls, which frees every stage's work.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from easerve.errors import BadRequest, CacheMiss, DecodeStalled, Internal, Overloaded, Unavailable
from easerve.media import MediaResolver, config_for
from easerve.wire.protoconv import FINISH_FROM_PROTO, media_item_to_proto
from easerve.wire.sampling_proto import sampling_to_proto
from easerve.rpc.deadline import Deadline
from easerve.rpc.server import ServerOptions
from easerve.engine.config import default_max_len
from easerve.stages.common.configs import GatewayConfig
from easerve.stages.common.limits import InflightLimit
from easerve.stages.common.peers import peers_of
from easerve.types import MODALITIES, ChatMessage, MediaPart, ProcessedPrompt, Timings
from easerve.wire.v1 import common_pb2 as cpb
from easerve.wire.v1 import decode_pb2, decode_pb2_grpc, encode_pb2, encode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from easerve.cache.gateway import MediaCache, MediaPlan
from easerve.stages.gateway.admission import GatewayAdmission
from easerve.cache.prefix import PrefixCacheConfig
from easerve.cache.prefix_route import PrefixRoute, up_loads
from easerve.stages.gateway.choices import Delta, chunk_logprobs, decode_chunks, drain, fan_in
from easerve.stages.gateway.job import Job, new_internal_id
from easerve.stages.gateway.legs import Leg, resumable

__all__ = ["GatewayConfig", "GatewayCore", "Delta"]
log = logging.getLogger("easerve.gateway")


UPSTREAM_ATTEMPTS = 2  # an upstream call failing before its first token is tried on one more instance


class GatewayCore:
    def __init__(self, cfg: GatewayConfig, adapter, metrics, media: MediaResolver | None = None):
        self.cfg, self.adapter, self.m = cfg, adapter, metrics
        self.media = media or MediaResolver(config_for(adapter))  # fetches and decodes a Job's MediaRefs
        self.started = int(time.time())
        self.limit = InflightLimit(cfg.max_inflight, "the gateway")
        self.max_model_len = cfg.max_model_len or default_max_len(adapter.text_config)
        self._pool = concurrent.futures.ThreadPoolExecutor(cfg.preprocess_threads, thread_name_prefix="preprocess")
        self.host = metrics.host
        self.host_records: collections.deque[Job] = collections.deque(maxlen=1000)  # /trace's host_cpu_ms
        so = ServerOptions.of(cfg)
        opts, tls = so.channel_options(), so.tls
        self._enc = peers_of(cfg, "encode", encode_pb2_grpc.EncodeStub, opts, "easerve.v1.Encode", tls=tls)
        self._pre = peers_of(cfg, "prefill", prefill_pb2_grpc.PrefillStub, opts, "easerve.v1.Prefill", tls=tls)
        self._dec = peers_of(cfg, "decode", decode_pb2_grpc.DecodeStub, opts, "easerve.v1.Decode", tls=tls)
        self.admission = GatewayAdmission.of(cfg, self._enc, self._pre, self._dec, metrics)
        self.prefix_route = PrefixRoute(PrefixCacheConfig().block_tokens)  # text-only prompts to prefill
        self.cache = MediaCache(adapter, self.media.cfg, self._enc, cfg.media_hash_entries,
                                cfg.encoder_cache_affinity) if cfg.media_hash_entries and cfg.encode else None

    def start(self) -> None:
        for peers in (self._enc, self._pre, self._dec):
            peers.start()

    async def stop(self) -> None:
        for peers in (self._enc, self._pre, self._dec):
            await peers.close()

    # ---- preprocessing ------------------------------------------------------------------
    async def warm(self) -> None:
        """Run the HF processor once per modality of the model, in the preprocessing threads,
        before the gateway turns SERVING: what it loads lazily on first use (processor classes,
        their imports) then costs the first request of each kind nothing, and does not hold the
        GIL for ~0.1-0.2 s under the event loop while traffic is on."""
        from easerve.stages.encode.profiler import synthetic_part

        def one(modality: str) -> None:
            self.adapter.preprocess([{"role": "user", "content": [synthetic_part(modality), {"type": "text", "text": "x"}]}])
        loop = asyncio.get_running_loop()
        for modality in getattr(self.adapter, "modalities", ()):
            await loop.run_in_executor(self._pool, one, modality)

    def _preprocess_sync(self, job: Job, messages: tuple[ChatMessage, ...] | None,
                         media: tuple[MediaPart, ...]) -> ProcessedPrompt:
        if messages is not None:
            return self.adapter.preprocess(messages)
        if job.prompt_ids is not None:
            return ProcessedPrompt(input_ids=list(job.prompt_ids))
        by_kind = {k: [p.value for p in media if p.kind == k] for k in MODALITIES}
        return self.adapter.preprocess_prompt(job.prompt or "", images=by_kind["image"],
                                              videos=by_kind["video"], audios=by_kind["audio"])

    def _preprocess_known(self, job: Job, known: dict) -> ProcessedPrompt:
        """The prompt of media preprocessed before (learned pixel-free items): no decoding, no processor."""
        if job.messages is not None:
            return self.adapter.prompt_from_items(self.adapter.chat_text(job.messages), known, chat=True)
        return self.adapter.prompt_from_items(job.prompt or "", known, chat=False)

    async def _processed(self, job: Job) -> ProcessedPrompt:
        """Full preprocessing: fetch and decode the media, run the HF processor."""
        parts = await self.media.resolve(job.media_parts(), lambda s: self.host.add("media", s, job.host))
        messages, media = job.with_media(parts)
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self.host.timed("tokenize", self._preprocess_sync, job.host), job, messages, media)

    async def _prepare(self, job: Job) -> ProcessedPrompt:
        """Hash the media as received, plan the encode (easerve.cache.gateway), and skip
        decoding and the processor when the planned encode instance holds every item."""
        parts = job.media_parts() if self.cache is not None and job.prompt_ids is None else []
        if not parts:
            return await self._processed(job)
        loop = asyncio.get_running_loop()
        parts = await self.media.fetch(parts, lambda s: self.host.add("media", s, job.host))
        job.messages, job.media = job.with_media(parts)  # fetched once, for a full preprocess too
        pairs = await loop.run_in_executor(self._pool, self.host.timed("media", self.cache.hash_parts, job.host), parts)
        job.media_plan = plan = await self.cache.plan(pairs, self._deadline(job).timeout())
        known = self.cache.known_items(plan) if plan.all_held else None
        if known is not None:
            prompt = await loop.run_in_executor(self._pool, self.host.timed("tokenize", self._preprocess_known,
                                                                            job.host), job, known)
            plan.skipped = True
            return prompt
        prompt = await self._processed(job)
        self.cache.learn(plan, prompt)
        return prompt

    async def preprocess(self, job: Job) -> ProcessedPrompt:
        t0 = time.monotonic()
        if job.sampling.structured is not None:  # an invalid schema, regex or grammar is the client's (400)
            from easerve.engine import grammar  # xgrammar loads only once a structured output comes
            with self.host.phase("parse", job.host):
                grammar.parse(job.sampling.structured)
        # MediaError and the adapter's InvalidRequests are the client's (400); any other error is ours (500)
        prompt = await self._prepare(job)
        job.preprocess_ms = (time.monotonic() - t0) * 1000
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
        meta = cpb.RequestMeta(request_id=job.internal_id, deadline_ms=deadline.to_ms(), model=self.cfg.served_model)
        d = job.admission
        if d is not None:  # its SLO deadline and class, for the batcher's deadline order
            meta.slo_ttft_ms = max(1, round((d.deadline - time.monotonic()) * 1000))
            meta.yields = d.yields
        return meta

    async def _upstream(self, job: Job, prompt: ProcessedPrompt, deadline: Deadline, decode_addr: str,
                        failed: set[str]):
        """(peers, peer, call, first message) of the stage that computes the first token; an
        instance whose call fails before its first message is added to `failed`, not retried
        here (`_reserved_call` retries with a new reservation)."""
        if self.admission is not None:
            self.admission.placed(job)
        meta, sp = self._meta(job, deadline), sampling_to_proto(job.sampling)
        target = cpb.DecodeTarget(address=decode_addr)
        if prompt.items:
            if not self._enc:
                raise BadRequest("this deployment has no encode stage; send text only")
            return (self._enc, *await self._encode_call(job, prompt, deadline, decode_addr, failed,
                                                        dict(meta=meta, input_ids=prompt.input_ids, sampling=sp,
                                                             decode=target)))
        with self.host.phase("serialize", job.host):
            req = prefill_pb2.PrefillRequest(meta=meta, input_ids=prompt.input_ids, sampling=sp, decode=target)
        with self.host.phase("schedule", job.host):
            hashes = self.prefix_route.hashes(prompt.input_ids)
            prefer = decode_addr if decode_addr in self._pre.addrs else self.prefix_route.prefer(hashes,
                                                                                                 up_loads(self._pre))
        started = await self._pre.start_call(lambda p: p.stub.Prefill(req, timeout=deadline.timeout()), prefer=prefer,
                                             failed=failed, retries=0)
        self.prefix_route.sent(hashes, started[0].addr)
        return (self._pre, *started)

    # ---- encoder cache: pixel-free items, late misses ---------------------------------------------
    async def _encode_call(self, job: Job, prompt: ProcessedPrompt, deadline: Deadline, decode_addr: str,
                           failed: set[str], fields: dict):
        """Open the encode call on the instance the media plan chose (in a monolith: the one
        holding the reservation). Items it said it holds go without their pixels (all items,
        when preprocessing was skipped); if it no longer holds one when the request comes
        (a CacheMiss: NOT_FOUND with its reason code), the request is preprocessed in full if
        it was not, and resent with every item's pixels."""
        plan = job.media_plan
        target = decode_addr if decode_addr in self._enc.addrs else (plan.target if plan else None)
        held = self.cache.held_items(plan, prompt, target) if plan else [False] * len(prompt.items)
        if any(held):
            req = await self._encode_request(job, prompt, fields, held)
            try:
                return await self._started(plan, req, deadline, target, failed)
            except CacheMiss as e:  # its reason code, not its words (the peer's name is in front)
                log.info("request %s: late encoder cache miss at %s (%s); resending with pixels",
                         job.request_id, target, e)
                self.cache.missed(plan, target)
                self.m.cache_late_misses.inc()
            if plan.skipped:
                prompt = await self._reprocess(job, prompt)
        req = await self._encode_request(job, prompt, fields, [False] * len(prompt.items))
        return await self._started(plan, req, deadline, target or decode_addr, failed)

    async def _reprocess(self, job: Job, skipped: ProcessedPrompt) -> ProcessedPrompt:
        """The full preprocessing a late miss needs after a skipped one; the same token ids."""
        t0 = time.monotonic()
        prompt = await self._processed(job)
        job.media_plan.skipped = False
        self.cache.learn(job.media_plan, prompt)
        job.preprocess_ms += (time.monotonic() - t0) * 1000
        if prompt.input_ids != job.sampling.prompt_ids(skipped.input_ids):
            raise Internal(f"request {job.request_id}: the prompt built from learned media metadata differs "
                           "from the processor's; this is a bug, please report it")
        return replace(prompt, input_ids=list(skipped.input_ids))  # a migrated request's: + its resumed tokens

    async def _encode_request(self, job: Job, prompt: ProcessedPrompt, fields: dict, held: list[bool]):
        def build():  # pixel copies: off the loop
            items = [media_item_to_proto(it, with_inputs=not h) for it, h in zip(prompt.items, held)]
            return encode_pb2.EncodeRequest(items=items, **fields)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.host.timed("serialize", build,
                                                                                            job.host))

    async def _started(self, plan: MediaPlan | None, req, deadline: Deadline, prefer: str | None,
                       failed: set[str]):
        peer, call, first = await self._enc.start_call(lambda p: p.stub.Encode(req, timeout=deadline.timeout()),
                                                       prefer=prefer, failed=failed, retries=0)
        if plan is not None and peer.addr != plan.target:
            self.cache.sent(plan, peer.addr)
        return peer, call, first

    async def generate(self, job: Job) -> AsyncIterator[Delta]:
        """Yield text deltas; the last one carries finish_reason and usage."""
        with self.limit.admit():
            async for d in self._generate(job):
                yield d

    async def _generate(self, job: Job) -> AsyncIterator[Delta]:
        self.m.requests_running.inc()
        self.m.requests_waiting.inc()
        self.host_records.append(job)
        waiting = True
        try:
            prompt = await self.preprocess(job)
            if self.admission is not None:  # text only too: it skips encode, not admission
                with self.host.phase("schedule", job.host):
                    self.admission.admit(job, prompt.items[0].modality if prompt.items else "text",
                                         len(prompt.input_ids))
            async for d in self._stream(job, prompt):
                if waiting:
                    waiting = False
                    self.m.requests_waiting.dec()
                yield d
        finally:
            if self.admission is not None:  # done, or ended without a first token (failed, gone)
                self.admission.ended(job)
            self.m.requests_running.dec()
            if waiting:
                self.m.requests_waiting.dec()

    async def _reserved_call(self, job: Job, prompt: ProcessedPrompt, deadline: Deadline,
                             avoid: frozenset[str] = frozenset()):
        """(decode peer, decode call, upstream peers, upstream peer, upstream call, its first
        message): a place held at decode (not on an instance in `avoid`) and the upstream call
        that fills it. An upstream call
        that fails before its first message (its instance refused it, died or lost its own
        downstream) is tried once more on another instance, under a new internal id and a new
        reservation: the failed call may have handed its KV to the first place already, which
        then decodes (or has finished) a request whose first token never came back."""
        failed: set[str] = set()  # upstream instances whose call failed before its first message
        plan = job.media_plan  # a monolith holding the media also takes the reservation, when it can
        pinned = plan.target if plan is not None and plan.target in self._dec.addrs else None
        for attempt in range(UPSTREAM_ATTEMPTS):
            if attempt:
                job.internal_id = new_internal_id()
            reserve = decode_pb2.ReserveRequest(meta=self._meta(job, deadline), num_tokens=len(prompt.input_ids),
                                                max_new_tokens=job.sampling.tokens_left, n=job.sampling.n)
            dpeer, dcall, _ack = await self._dec.start_call(
                lambda p: p.stub.Open(reserve, timeout=deadline.timeout()), prefer=pinned, failed=set(avoid))
            before = len(failed)
            try:
                return (dpeer, dcall, *await self._upstream(job, prompt, deadline, dpeer.addr, failed))
            except (Unavailable, Overloaded) as e:
                dcall.cancel()  # the place and any KV the failed call sent there are freed
                self._dec.finish(dpeer)
                others = (self._enc if prompt.items else self._pre).untried(failed)
                if len(failed) == before or not others or attempt + 1 == UPSTREAM_ATTEMPTS:
                    raise  # none failed mid-call (none up), none left to try, or the last attempt
                log.info("request %s: %s; retrying with a new reservation", job.request_id, e)
            except BaseException:
                dcall.cancel()
                self._dec.finish(dpeer)
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def trace(self, last: int) -> dict:
        """GET /trace: the latest requests' records (admission's, with --profile), each with its
        host CPU milliseconds by phase (`host_cpu_ms`)."""
        jobs = list(self.host_records)[-last:] if last > 0 else []
        if self.admission is None:
            recs = [{"request_id": j.request_id, "host_cpu_ms": j.host.as_ms()} for j in jobs]
            return {"admission": "off", "requests": recs}
        out = self.admission.trace(last)
        host = {j.request_id: j.host for j in jobs}
        out["requests"] = [{**r, "host_cpu_ms": host[r["request_id"]].as_ms()} if r["request_id"] in host else r
                           for r in out["requests"]]
        return out

    async def _stream(self, job: Job, prompt: ProcessedPrompt) -> AsyncIterator[Delta]:
        deadline = self._deadline(job)
        leg = Leg(*await self._reserved_call(job, prompt, deadline))
        try:
            if job.sampling.n > 1:
                async for d in fan_in(self, job, prompt, leg.first, leg.ucall, leg.dcall, leg.dpeer.addr):
                    yield d
                return
            delta = self._first(job, prompt, leg.first)
            first_at, sent = time.monotonic(), list(delta.token_ids)  # sent: the token ids the client has
            while True:
                yield delta
                if delta.finish_reason is not None:
                    return
                leg.tail = asyncio.ensure_future(drain(leg.ucall))
                try:
                    async for d in self._decoded(job, prompt, leg, len(sent), first_at):
                        sent += d.token_ids
                        yield d
                    return
                except Unavailable as e:  # its decode instance died or stalled, or the KV handoff failed
                    if (job.migrations >= self.cfg.migration_limit or not self._dec.untried({leg.dpeer.addr})
                            or not resumable(self.adapter, job, sent)):
                        raise  # no move left, no other decode instance listed, or none possible
                    reason = "stalled" if isinstance(e, DecodeStalled) else "died"
                    log.warning("request %s: %s; migrating after %d token(s)", job.request_id, e, len(sent))
                    leg.close(self._dec)
                    leg = await self._migrate(job, prompt, sent, deadline, leg.dpeer.addr)
                    self.m.migrations.inc(stage="decode", reason=reason)
                    delta = self._resumed(job, prompt, leg.first, len(sent) + 1, first_at)
                    sent += delta.token_ids
        finally:
            leg.close(self._dec)

    async def _migrate(self, job: Job, prompt: ProcessedPrompt, sent: list[int], deadline: Deadline,
                       left: str) -> Leg:
        """A new leg for a request whose decode stream (at `left`) broke after the tokens `sent`:
        prompt + sent prefilled again (the prefix cache holds most of it when it can), on
        another decode instance, under a new internal id; its first message is the next token."""
        job.migrations += 1
        job.sampling = replace(job.sampling, resumed=tuple(sent))
        job.internal_id = new_internal_id()
        resumed = replace(prompt, input_ids=[*prompt.input_ids, *sent])
        return Leg(*await self._reserved_call(job, resumed, deadline, frozenset({left})))

    def _resumed(self, job: Job, prompt: ProcessedPrompt, chunk, n: int, first_at: float) -> Delta:
        """The delta of a migrated request's first chunk (its `n`-th token)."""
        finish = FINISH_FROM_PROTO[chunk.finish_reason]
        if finish is not None:
            return self._last(job, prompt, chunk, finish, n, first_at, Timings())
        return Delta(list(chunk.token_ids), chunk.text, logprobs=chunk_logprobs(chunk))

    def _first(self, job: Job, prompt: ProcessedPrompt, chunk) -> Delta:
        timings = self._first_timings(job, chunk)
        finish = FINISH_FROM_PROTO[chunk.finish_reason]
        if finish is not None:
            return self._last(job, prompt, chunk, finish, 1, None, timings)
        return Delta(list(chunk.token_ids), chunk.text, timings=timings, logprobs=chunk_logprobs(chunk))

    def _first_timings(self, job: Job, chunk) -> Timings:
        """The first token's timings (and its metrics); notes the prefix cache's hit on `job`."""
        ttft = time.monotonic() - job.received
        self.m.ttft.observe(ttft)
        if self.admission is not None:
            self.admission.first_token(job, ttft)
        t = chunk.timings
        for stage, ms in (("encode", t.encode_ms), ("prefill", t.prefill_ms), ("queue", t.queue_ms),
                          ("embed_transfer", t.embed_transfer_ms), ("preprocess", job.preprocess_ms)):
            if ms > 0:
                self.m.stage_latency.observe(ms / 1000.0, stage=stage)
        skipped = bool(job.media_plan and job.media_plan.skipped)  # still so after the encode call: no late miss
        if skipped:
            self.m.preprocess_skipped.inc()
        job.cached_tokens = chunk.usage.cached_tokens
        return Timings(ttft_ms=ttft * 1000, encode_ms=t.encode_ms, queue_ms=t.queue_ms, prefill_ms=t.prefill_ms,
                       embed_transfer_ms=t.embed_transfer_ms, encode_cache_hits=t.encode_cache_hits,
                       preprocess_ms=job.preprocess_ms, preprocess_skipped=skipped)

    async def _decoded(self, job: Job, prompt: ProcessedPrompt, leg: Leg, n: int,
                       first_at: float) -> AsyncIterator[Delta]:
        """Decode's chunks after the `n` tokens sent (the first at `first_at`), failing at once
        if the upstream call (the KV handoff) fails, and when decode sends no token for
        --decode-progress-timeout-s; a failure of the stream names the decode instance and
        how far the request got."""
        progress_s = self.cfg.decode_progress_timeout_s
        async for chunk in decode_chunks(leg.dcall, leg.tail, leg.dpeer.addr, n, progress_s):
            n += len(chunk.token_ids)
            finish = FINISH_FROM_PROTO[chunk.finish_reason]
            if finish is not None:
                timings = Timings(kv_transfer_ms=chunk.timings.kv_transfer_ms)
                yield self._last(job, prompt, chunk, finish, n, first_at, timings)
                return
            yield Delta(list(chunk.token_ids), chunk.text, logprobs=chunk_logprobs(chunk))

    def _last(self, job, prompt, chunk, finish, n, first_at, timings: Timings, steps: int = 0) -> Delta:
        """The request's last delta: `n` tokens in all, `steps` (default n) of the longest choice."""
        now, steps = time.monotonic(), steps or n
        tpot = (now - first_at) / (steps - 1) if first_at is not None and steps > 1 else 0.0
        if steps > 1:
            self.m.tpot.observe(tpot)
        if self.admission is not None:
            self.admission.finished(job, tpot if steps > 1 else None)
        self.m.e2e.observe(now - job.received)
        self.m.finished.inc(finished_reason=finish)
        self.m.prompt_tokens.inc(len(prompt.input_ids))
        self.m.generation_tokens.inc(n)
        return Delta(list(chunk.token_ids), chunk.text, finish, len(prompt.input_ids), n,
                     replace(timings, tpot_ms=tpot * 1000), chunk_logprobs(chunk), job.cached_tokens,
                     migrations=job.migrations)

