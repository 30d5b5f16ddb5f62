"""The EAServe Python SDK: `Client` (blocking) and `AsyncClient` (asyncio) over the gateway's gRPC API.

    with Client("127.0.0.1:50051") as c:
        out = c.generate("What is in the picture?", images=["cat.png"], max_tokens=32)
        for chunk in c.generate("Tell a story", stream=True):
            print(chunk.text, end="")

`api_key` (default $EASERVE_API_KEY) is sent as `authorization: Bearer KEY` on every call, for
a gateway started with --api-key; `tls=Tls(ca="ca.pem")` (easerve.rpc.tls) talks TLS to a
gateway started with --tls-cert (add cert= / key= for one that asks for client certificates).

Errors are the domain errors of `easerve.errors` (`easerve.rpc.errors` maps them to status
codes), also under the SDK's names below (`easerve.OverloadedError` is `easerve.errors.Overloaded`).
Leaving a stream early (break, `close()`, garbage collection) cancels the RPC, and with it every
stage's work for the request.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, replace

import grpc

from easerve.client_request import build_request
from easerve import errors as _errors
from easerve.rpc.errors import from_rpc_error
from easerve.rpc.tls import NO_TLS, Tls, aio_channel, sync_channel
from easerve.types import Timings
from easerve.wire.sampling_proto import timings_from_proto
from easerve.wire.v1 import common_pb2 as cpb
from easerve.wire.v1 import gateway_pb2 as gpb
from easerve.wire.v1 import gateway_pb2_grpc

EAServeError = _errors.EAServeError
InvalidRequestError = _errors.InvalidRequest
NotFoundError = _errors.NotFound
OverloadedError = _errors.Overloaded
UnavailableError = _errors.Unavailable
DeadlineExceededError = _errors.DeadlineExceeded
RequestCancelled = _errors.Cancelled
InternalError = _errors.Internal
UnauthenticatedError = _errors.Unauthenticated
MessageTooLargeError = _errors.MessageTooLarge

DEFAULT_TARGET = "127.0.0.1:50051"
CHANNEL_OPTIONS = (("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20),
                   ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 20_000),
                   ("grpc.http2.max_pings_without_data", 0))  # the gateway accepts pings >= 0.5 s apart
FINISH_REASONS = {cpb.FINISH_REASON_STOP: "stop", cpb.FINISH_REASON_LENGTH: "length",
                  cpb.FINISH_REASON_CANCELLED: "cancelled", cpb.FINISH_REASON_ERROR: "error"}


# ---- results ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens answered by prefill's prefix cache
    migrations: int = 0     # times the stream moved to another decode instance (one died or stalled)


@dataclass(frozen=True)
class Logprob:
    """One output token's log-probability and its most likely alternatives ((id, logprob), best first)."""
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Chunk:
    """One streamed delta. `finish_reason` is set on the last chunk of its choice (`index`,
    0..n-1), `usage` on the stream's last chunk only (completion tokens summed over the
    choices); `logprobs` (one per token id) when the request asked for them."""
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    request_id: str = ""
    logprobs: tuple[Logprob, ...] = ()
    index: int = 0


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    usage: Usage
    timings: Timings
    request_id: str = ""
    logprobs: tuple[Logprob, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    id: str
    family: str
    modalities: tuple[str, ...]
    max_model_len: int
    created: int


def chunk_from_proto(m: gpb.GenerateResponse) -> Chunk:
    finish = FINISH_REASONS.get(m.finish_reason)
    usage = (Usage(m.usage.prompt_tokens, m.usage.completion_tokens, m.usage.cached_tokens, m.usage.migrations)
             if finish and m.HasField("usage") else None)
    timings = timings_from_proto(m.timings) if m.HasField("timings") else None
    lps = tuple(Logprob(lp.logprob, tuple(zip(lp.top_ids, lp.top_logprobs))) for lp in m.logprobs)
    return Chunk(m.text, tuple(m.token_ids), finish, usage, timings, m.request_id, lps, m.index)


def collect(chunks: Iterable[Chunk]) -> Completion:
    text, ids, lps, last, timings = [], [], [], None, Timings()
    for c in chunks:
        text.append(c.text)
        ids.extend(c.token_ids)
        lps.extend(c.logprobs)
        timings, last = timings.merge(c.timings), c
    if last is None:
        raise UnavailableError("the gateway closed the stream without a result")
    return Completion("".join(text), tuple(ids), last.finish_reason, last.usage or Usage(), timings,
                      last.request_id, tuple(lps))


def collect_choices(chunks: Iterable[Chunk], n: int) -> list[Completion]:
    """The n choices of a request's chunks, by index; each carries the request's usage
    (completion tokens summed over the choices) and timings."""
    by: list[list[Chunk]] = [[] for _ in range(n)]
    usage, timings = Usage(), Timings()
    for c in chunks:
        if not 0 <= c.index < n:
            raise UnavailableError(f"the gateway sent choice {c.index} of a request for n = {n}")
        by[c.index].append(c)
        usage, timings = c.usage or usage, timings.merge(c.timings)
    return [replace(collect(cs), usage=usage, timings=timings) for cs in by]




def _model_info(m: gpb.ModelInfo) -> ModelInfo:
    return ModelInfo(m.id, m.family, tuple(m.modalities), m.max_model_len, m.created)


# ---- streams ---------------------------------------------------------------------------------
class Stream:
    """Iterator of `Chunk`s of one Generate call; `close()` (or leaving early) cancels the RPC."""

    def __init__(self, call):
        self._call = call

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        try:
            return chunk_from_proto(next(self._call))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def close(self) -> None:
        self._call.cancel()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        call = getattr(self, "_call", None)
        if call is not None:
            call.cancel()


class AsyncStream:
    """Async iterator of `Chunk`s; `close()`, `async with` exit or garbage collection cancels the RPC."""

    def __init__(self, call):
        self._call = call

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        try:
            msg = await self._call.read()
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        if msg is grpc.aio.EOF:
            raise StopAsyncIteration
        return chunk_from_proto(msg)

    def close(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        call = getattr(self, "_call", None)
        if call is not None and not call.done():
            call.cancel()


async def _acollect(stream: AsyncStream, n: int = 1) -> Completion | list[Completion]:
    chunks = [c async for c in stream]
    return collect(chunks) if n == 1 else collect_choices(chunks, n)


# ---- clients ---------------------------------------------------------------------------------
class _Base:
    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None, model: str = "",
                 api_key: str | None = None, tls: Tls = NO_TLS):
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds (or None for no deadline), got {timeout}")
        self.target, self.timeout, self.model, self.tls = target, timeout, model, tls
        key = os.environ.get("EASERVE_API_KEY", "") if api_key is None else api_key
        self._metadata = (("authorization", f"Bearer {key}"),) if key else ()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _request(self, prompt, model, kw) -> gpb.GenerateRequest:
        return build_request(prompt, model=model if model is not None else self.model, **kw)

    def _call_metadata(self, slo_tier: str | None, priority: str | None) -> tuple:
        """The key's metadata plus the request's SLO tier and priority class (the gateway's
        SLO-aware admission; None: the gateway's defaults)."""
        extra = tuple((k, v) for k, v in (("x-easerve-slo-tier", slo_tier), ("x-easerve-priority", priority)) if v)
        return self._metadata + extra


class Client(_Base):
    """Blocking client of the gateway's gRPC API.

    `generate(...)`: `prompt` (chat template applied; media go first in the user message),
    or `messages` (OpenAI-style dicts with content parts), or `raw_prompt` (used as is, its
    placeholders matching `images` / `video` / `audio` in order). Images: bytes, PIL images,
    file paths or data: URIs; video: list of frames or a file; audio: WAV bytes, a path or
    (float32 samples, sample_rate). Returns a `Completion`, or with stream=True a `Stream` of `Chunk`s.
    Sampling arguments take vLLM's meanings (see `easerve.types.SamplingParams`); `logit_bias` maps
    token ids to a bias in [-100, 100]. `slo_tier` ("tight", "moderate", "loose") and `priority`
    ("interactive", "batch") go as metadata to the gateway's SLO-aware admission.
    `n` > 1 (at most 16): n choices of one prefill; a list of n `Completion`s (choice i at i),
    or a stream whose chunks carry their choice's `index`. With a seed, choice i samples with seed + i.
    Structured outputs: `response_format` as OpenAI's
    ({"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} or {"type": "json_object"}),
    or `structured_outputs` as vLLM's ({"json": schema}, {"regex": ...}, {"choice": [...]}, {"grammar": EBNF}).
    """

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None, model: str = "",
                 api_key: str | None = None, tls: Tls = NO_TLS):
        super().__init__(target, timeout=timeout, model=model, api_key=api_key, tls=tls)
        self._channel = sync_channel(target, CHANNEL_OPTIONS, tls)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)

    def generate(self, prompt: str | None = None, *, messages=None, raw_prompt: str | None = None, images=(),
                 video=None, audio=None, video_fps: float = 0.0, model: str | None = None, max_tokens: int = 256,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop=(),
                 stop_token_ids=(), ignore_eos: bool = False, logprobs: int | None = None, stream: bool = False,
                 timeout: float | None = None, request_id: str | None = None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, min_p: float = 0.0,
                 min_tokens: int = 0, logit_bias: dict[int, float] | None = None, slo_tier: str | None = None,
                 priority: str | None = None, response_format: dict | None = None,
                 structured_outputs: dict | None = None, n: int = 1) -> Completion | list[Completion] | Stream:
        req = self._request(prompt, model, dict(
            messages=messages, raw_prompt=raw_prompt, images=images, video=video, audio=audio, video_fps=video_fps,
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, logprobs=logprobs, request_id=request_id,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty, min_p=min_p, min_tokens=min_tokens, logit_bias=logit_bias,
            response_format=response_format, structured_outputs=structured_outputs, n=n))
        out = Stream(self._stub.Generate(req, timeout=self._timeout(timeout),
                                         metadata=self._call_metadata(slo_tier, priority)))
        if stream:
            return out
        with out:
            return collect(out) if n == 1 else collect_choices(out, n)

    def list_models(self, timeout: float | None = None) -> list[ModelInfo]:
        try:
            resp = self._stub.ListModels(gpb.ListModelsRequest(), timeout=self._timeout(timeout),
                                         metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return [_model_info(m) for m in resp.models]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio twin of `Client` (grpc.aio); `await generate(...)` returns a Completion or an AsyncStream."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None, model: str = "",
                 api_key: str | None = None, tls: Tls = NO_TLS):
        super().__init__(target, timeout=timeout, model=model, api_key=api_key, tls=tls)
        self._channel = None  # made on first use, inside the caller's event loop

    def _stub(self) -> gateway_pb2_grpc.GatewayStub:
        if self._channel is None:
            self._channel = aio_channel(self.target, CHANNEL_OPTIONS, self.tls)
        return gateway_pb2_grpc.GatewayStub(self._channel)

    async def generate(self, prompt: str | None = None, *, messages=None, raw_prompt: str | None = None, images=(),
                       video=None, audio=None, video_fps: float = 0.0, model: str | None = None,
                       max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                       seed: int | None = None, stop=(), stop_token_ids=(), ignore_eos: bool = False,
                       logprobs: int | None = None, stream: bool = False, timeout: float | None = None,
                       request_id: str | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                       repetition_penalty: float = 1.0, min_p: float = 0.0, min_tokens: int = 0,
                       logit_bias: dict[int, float] | None = None, slo_tier: str | None = None,
                       priority: str | None = None, response_format: dict | None = None,
                       structured_outputs: dict | None = None,
                       n: int = 1) -> Completion | list[Completion] | AsyncStream:
        req = self._request(prompt, model, dict(
            messages=messages, raw_prompt=raw_prompt, images=images, video=video, audio=audio, video_fps=video_fps,
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
            stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, logprobs=logprobs, request_id=request_id,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty, min_p=min_p, min_tokens=min_tokens, logit_bias=logit_bias,
            response_format=response_format, structured_outputs=structured_outputs, n=n))
        out = AsyncStream(self._stub().Generate(req, timeout=self._timeout(timeout),
                                                metadata=self._call_metadata(slo_tier, priority)))
        if stream:
            return out
        async with out:
            return await _acollect(out, n)

    async def list_models(self, timeout: float | None = None) -> list[ModelInfo]:
        try:
            resp = await self._stub().ListModels(gpb.ListModelsRequest(), timeout=self._timeout(timeout),
                                                 metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return [_model_info(m) for m in resp.models]

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
