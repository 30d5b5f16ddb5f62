"""The gateway's domain logic, shared by its gRPC and HTTP fronts.

A request is preprocessed here (chat template, tokenization, the HF processor on
decoded media), sent to an encode worker (media) or straight to a prefill worker
(text only) with the remaining deadline, and the token stream that comes back up
the chain is detokenized here, where stop strings are also applied.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from easerve.codec import sampling_to_proto
from easerve.engine.detok import Detokenizer
from easerve.rpc.server import ServerOptions
from easerve.stages.cli import default_max_len
from easerve.stages.convert import FINISH_FROM_PROTO, media_item_to_proto
from easerve.stages.limits import InflightLimit
from easerve.stages.peers import Peers, relay
from easerve.types import ProcessedPrompt, SamplingParams
from easerve.v1 import common_pb2 as cpb
from easerve.v1 import encode_pb2, encode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.gateway.openai_api import BadRequest


@dataclass(frozen=True)
class GatewayConfig:
    served_model: str
    encode_addrs: tuple[str, ...]
    prefill_addrs: tuple[str, ...]
    request_timeout_s: float = 600.0
    default_max_tokens: int = 256
    preprocess_threads: int = 2
    max_inflight: int = 1024
    max_model_len: int | None = None  # None: easerve.stages.cli.default_max_len, as decode

    def __post_init__(self) -> None:
        if not self.prefill_addrs:
            raise ValueError("the gateway needs at least one --prefill address")
        if self.request_timeout_s <= 0:
            raise ValueError("--request-timeout-s must be > 0")


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
    """One request as the gateway sees it: chat messages or a raw prompt + media."""

    sampling: SamplingParams
    request_id: str
    messages: list[dict] | None = None
    prompt: str | None = None
    media: list[dict] = field(default_factory=list)
    prompt_ids: list[int] | None = None  # a token-id prompt (/v1/completions), no media
    timeout_s: float | None = None
    received: float = field(default_factory=time.monotonic)


class GatewayCore:
    def __init__(self, cfg: GatewayConfig, adapter, metrics):
        self.cfg, self.adapter, self.m = cfg, adapter, metrics
        self.started = int(time.time())
        self.limit = InflightLimit(cfg.max_inflight, "the gateway")
        self.max_model_len = cfg.max_model_len or default_max_len(adapter.text_config)
        self._pool = concurrent.futures.ThreadPoolExecutor(cfg.preprocess_threads, thread_name_prefix="preprocess")
        opts = ServerOptions().channel_options()
        self._enc = Peers(encode_pb2_grpc.EncodeStub, cfg.encode_addrs, opts)
        self._pre = Peers(prefill_pb2_grpc.PrefillStub, cfg.prefill_addrs, opts)

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
    def _call(self, job: Job, prompt: ProcessedPrompt, timeout: float):
        meta = cpb.RequestMeta(request_id=job.request_id, deadline_ms=int(timeout * 1000),
                               model=self.cfg.served_model)
        sp = sampling_to_proto(job.sampling)
        if prompt.items:
            if not self._enc:
                raise BadRequest("this deployment has no encode stage; send text only")
            req = encode_pb2.EncodeRequest(meta=meta, input_ids=prompt.input_ids, sampling=sp,
                                           items=[media_item_to_proto(it) for it in prompt.items])
            return self._enc.next().Encode(req, timeout=timeout)
        req = prefill_pb2.PrefillRequest(meta=meta, input_ids=prompt.input_ids, sampling=sp)
        return self._pre.next().Prefill(req, timeout=timeout)

    def _remaining(self, job: Job) -> float:
        budget = job.timeout_s or self.cfg.request_timeout_s
        left = budget - (time.monotonic() - job.received)
        if left <= 0:
            raise TimeoutError(f"request {job.request_id} ran out of its {budget:.1f} s deadline")
        return left

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
        call = self._call(job, prompt, self._remaining(job))
        detok = Detokenizer(self.adapter.tokenizer, prompt.input_ids[-8:], job.sampling.stop)
        n, first_at, timings = 0, None, {}
        chunks = relay(call)
        try:
            async for chunk in chunks:
                ids = list(chunk.token_ids)
                text = "".join(detok.push(t) for t in ids)
                n += len(ids)
                if first_at is None and ids:
                    first_at = time.monotonic()
                    timings = self._first_timings(job, chunk)
                finish = "stop" if detok.stop_hit else FINISH_FROM_PROTO[chunk.finish_reason]
                if finish is not None:
                    yield self._last(job, prompt, detok, ids, text, finish, n, first_at)
                    return
                yield Delta(ids, text, timings=timings)
                timings = {}
            raise ConnectionError("the pipeline closed the stream before the request finished")
        finally:
            await chunks.aclose()

    def _first_timings(self, job: Job, chunk) -> dict:
        ttft = time.monotonic() - job.received
        self.m.ttft.observe(ttft)
        t = chunk.timings
        for stage, ms in (("encode", t.encode_ms), ("prefill", t.prefill_ms), ("queue", t.queue_ms),
                          ("embed_transfer", t.embed_transfer_ms)):
            if ms > 0:
                self.m.stage_latency.observe(ms / 1000.0, stage=stage)
        return {"ttft_ms": ttft * 1000, "encode_ms": t.encode_ms, "queue_ms": t.queue_ms,
                "prefill_ms": t.prefill_ms}

    def _last(self, job, prompt, detok, ids, text, finish, n, first_at) -> Delta:
        text += detok.finish()
        now = time.monotonic()
        tpot = (now - first_at) / (n - 1) if first_at is not None and n > 1 else 0.0
        if n > 1:
            self.m.tpot.observe(tpot)
        self.m.e2e.observe(now - job.received)
        self.m.finished.inc(reason=finish)
        self.m.prompt_tokens.inc(len(prompt.input_ids))
        self.m.generation_tokens.inc(n)
        return Delta(ids, text, finish, len(prompt.input_ids), n, {"tpot_ms": tpot * 1000})
