"""OpenAI-compatible HTTP front of the gateway (aiohttp).

POST /v1/chat/completions and POST /v1/completions (stream: true -> SSE ending in
[DONE]), GET /v1/models, GET /health, GET /metrics, GET /trace (each request's host CPU milliseconds
by phase; with --profile also its predicted and actual TTFT and its admission decision). Errors: 400 with what to change, 429 on overload,
503 when a stage is unavailable or the gateway drains (both with Retry-After), 504 past the
deadline, 502 when the pipeline's stream ends without a finish reason (an error event when
the SSE headers are out); the server keeps serving.
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator

from aiohttp import web

from easerve.errors import BadRequest, BadUpstream
from easerve.rpc.errors import domain_error, is_unexpected
from easerve.stages.common.host_time import HostAccount
from easerve.stages.gateway import openai_api as oa
from easerve.stages.gateway.admission import PRIORITY_HEADER, TIER_HEADER, checked_priority, checked_tier
from easerve.stages.gateway.choices import Delta, ended
from easerve.stages.gateway.core import GatewayCore
from easerve.stages.gateway.job import Job
from easerve.stages.gateway.tools import ToolCallStream

log = logging.getLogger("easerve.gateway")


def _error(status: int, message: str, retry_after_s: float | None = None) -> web.Response:
    kind = "invalid_request_error" if status == 400 else "server_error"
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
    return web.json_response(oa.error_json(message, kind, status), status=status, headers=headers)


def _message(e: BaseException) -> str:
    """What the client is told. A bug here (not a domain error) is logged with its traceback
    and answered 500 without its details: the client did nothing wrong."""
    if is_unexpected(e):
        log.error("unhandled error answering a request", exc_info=e)
        return f"internal error ({type(e).__name__}); the gateway's log has the traceback"
    return str(e) or type(e).__name__


async def _finished(deltas: AsyncIterator[Delta], n: int = 1) -> AsyncIterator[Delta]:
    """`deltas` up to the one with the n-th finish reason (one per choice); a stream that ends
    before it raises BadUpstream (502), so a cut-short answer never reads as a complete one."""
    finished = 0
    try:
        async for d in deltas:
            yield d
            finished += d.finish_reason is not None
            if ended(finished, n):
                return
        log.error("the pipeline ended a request's stream without a finish reason")
        raise BadUpstream("the pipeline ended the stream without a finish reason; the answer is cut short")
    finally:
        await deltas.aclose()  # client gone or done: cancels every stage's work


class HttpApi:
    """`ready()`: warmed up. After `drain()` new generation requests get 503 with
    Retry-After (and the connection closed), while the ones in flight finish."""

    def __init__(self, core: GatewayCore, max_body_bytes: int, ready, middlewares=()):
        self.core, self.ready, self.draining = core, ready, False
        self.app = web.Application(client_max_size=max_body_bytes,
                                   middlewares=[self._refuse_when_draining, *middlewares])
        self.app.add_routes([web.post("/v1/chat/completions", self.chat), web.post("/v1/completions", self.completions),
                             web.get("/v1/models", self.models),
                             web.get("/health", self.health), web.get("/metrics", self.metrics),
                             web.get("/trace", self.trace)])

    def drain(self) -> None:
        self.draining = True

    @web.middleware
    async def _refuse_when_draining(self, req: web.Request, handler):
        if self.draining and req.method == "POST":
            self.core.m.requests.inc(api="http", code="503")
            resp = _error(503, "the gateway is shutting down; retry (on another instance)", 1.0)
            resp.force_close()
            return resp
        return await handler(req)

    async def health(self, _req: web.Request) -> web.Response:
        if self.draining:
            return _error(503, "draining", 1.0)
        return web.json_response({"status": "ok"}) if self.ready() else _error(503, "warming up")

    async def metrics(self, _req: web.Request) -> web.Response:
        return web.Response(text=self.core.m.render(), content_type="text/plain", charset="utf-8")

    async def trace(self, req: web.Request) -> web.Response:
        """The latest requests' host CPU by phase and (with --profile) predicted and actual TTFT /
        TPOT and admission decisions (?last=N)."""
        try:
            last = int(req.query.get("last", "500"))
        except ValueError:
            return _error(400, f"last must be an integer, got {req.query.get('last')!r}")
        return web.json_response(self.core.trace(last))

    async def models(self, _req: web.Request) -> web.Response:
        return web.json_response(oa.models_json(self.core.cfg.served_model, self.core.max_model_len, self.core.started))

    async def _body(self, req: web.Request) -> bytes:
        try:
            return await req.read()
        except web.HTTPRequestEntityTooLarge:
            raise BadRequest(f"request body over {req.app._client_max_size} bytes; send smaller media") from None

    def _bad(self, e: BadRequest) -> web.Response:
        self.core.m.requests.inc(api="http", code="400")
        return _error(400, str(e))

    async def chat(self, req: web.Request) -> web.StreamResponse:
        acc = HostAccount()
        try:
            raw = await self._body(req)
            chat, job = parse_chat(self.core, raw, acc)
            _classify(job, req, chat)
        except BadRequest as e:
            return self._bad(e)
        tok = self.core.adapter.tokenizer
        return await self._answer(req, job, lambda i: _ChatShape(chat, tok, i), chat.stream, chat.include_usage)

    async def completions(self, req: web.Request) -> web.StreamResponse:
        acc = HostAccount()
        try:
            raw = await self._body(req)
            with self.core.host.phase("parse", acc):
                comp = oa.parse_completion_request(request_json(raw), self.core.cfg.served_model, self._vocab_size())
                job = Job(comp.sampling, comp.request_id, timeout_s=comp.timeout_s, host=acc)
                if isinstance(comp.prompt, str):
                    job.prompt = comp.prompt
                else:
                    self._check_ids(comp.prompt)
                    job.prompt_ids = comp.prompt
                _classify(job, req, comp)
        except BadRequest as e:
            return self._bad(e)
        tok = self.core.adapter.tokenizer
        return await self._answer(req, job, lambda i: _TextShape(comp, tok, i), comp.stream, comp.include_usage)

    def _vocab_size(self) -> int:
        a = self.core.adapter
        return min(len(a.tokenizer), int(getattr(a.text_config, "vocab_size", None) or len(a.tokenizer)))

    def _check_ids(self, ids: list[int]) -> None:
        media = {tid: mod for mod, tid in getattr(self.core.adapter, "placeholder_ids", {}).items()}
        hit = next((t for t in ids if t in media), None)
        if hit is not None:
            raise BadRequest(f"prompt: token id {hit} is the {media[hit]} placeholder; token-id prompts "
                                "take no media, send the media through /v1/chat/completions")

    async def _answer(self, req: web.Request, job: Job, shapes, stream: bool, usage: bool) -> web.StreamResponse:
        """`shapes(i)`: the bodies of choice i (each choice keeps its own streaming state)."""
        shapes = [shapes(i) for i in range(job.sampling.n)]
        if stream:
            return await self._stream(req, job, shapes, usage)
        return await self._unary(job, shapes)

    async def _unary(self, job: Job, shapes: list) -> web.Response:
        n = len(shapes)
        text, lps, finish, last = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n, None
        try:
            async for d in _finished(self.core.generate(job), n):
                text[d.index].append(d.text)
                lps[d.index] += zip(d.token_ids, d.logprobs)
                finish[d.index], last = d.finish_reason or finish[d.index], d
        except Exception as e:  # noqa: BLE001 - mapped to a status, server keeps serving
            return self._fail(e)
        self.core.m.requests.inc(api="http", code="200")
        with self.core.host.phase("detokenize", job.host):
            usage = oa.usage_json(last)
            bodies = [sh.whole("".join(text[i]), finish[i], usage, lps[i]) for i, sh in enumerate(shapes)]
            return web.json_response({**bodies[0], "choices": [b["choices"][0] for b in bodies]})

    def _fail(self, e: Exception) -> web.Response:
        err = domain_error(e)
        self.core.m.requests.inc(api="http", code=str(err.http))
        return _error(err.http, _message(e), err.retry_after_s)

    async def _stream(self, req: web.Request, job: Job, shapes: list, include_usage: bool) -> web.StreamResponse:
        gen = _finished(self.core.generate(job), len(shapes))
        created = int(time.time())
        try:  # fail before the 200 header when the request is bad or the pipeline refuses it
            first = await gen.__anext__()
        except Exception as e:  # noqa: BLE001
            return self._fail(e)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(req)
        for opening in (sh.opening(created) for sh in shapes):
            if opening is not None:
                await self._sse(resp, opening)
        try:
            d, finished = first, 0
            while True:
                with self.core.host.phase("detokenize", job.host):
                    event = _event(shapes[d.index].chunk(created, d.text, d.finish_reason,
                                                         list(zip(d.token_ids, d.logprobs))))
                await resp.write(event)
                finished += d.finish_reason is not None
                if ended(finished, len(shapes)):
                    break
                d = await gen.__anext__()
            if include_usage:
                await self._sse(resp, {**shapes[0].chunk(created, "", None, []), "choices": [],
                                       "usage": oa.usage_json(d)})
            self.core.m.requests.inc(api="http", code="200")
        except ConnectionResetError:
            pass
        except Exception as e:  # noqa: BLE001 - headers are out: report in-band
            await self._sse(resp, oa.error_json(_message(e), "server_error", domain_error(e).http))
        finally:
            await gen.aclose()  # client gone or done: cancels every stage's work
        try:
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            pass
        return resp

    @staticmethod
    async def _sse(resp: web.StreamResponse, obj: dict) -> None:
        await resp.write(_event(obj))


def _event(obj: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def request_json(raw: bytes) -> dict:
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, ints past the digit limit
        raise BadRequest(f"request body is not valid JSON: {e}") from None


def parse_chat(core: GatewayCore, raw: bytes, acc: HostAccount) -> tuple[oa.ChatRequest, Job]:
    """A /v1/chat/completions body -> the parsed request and its Job, the CPU charged to `acc`'s
    "parse" phase (`hasctl profile` times the gateway's preprocessing through this and
    `GatewayCore.preprocess`, as the live gateway runs it)."""
    with core.host.phase("parse", acc):
        a = core.adapter
        chat = oa.parse_chat_request(request_json(raw), core.cfg.served_model, a.modalities,
                                     a.sampling_rate, core.cfg.default_max_tokens)
        return chat, Job(chat.sampling, chat.request_id, messages=chat.messages, timeout_s=chat.timeout_s, host=acc)


def _classify(job: Job, req: web.Request, parsed) -> None:
    """The request's SLO tier and priority class: body field, else header, else the gateway's default."""
    job.slo_tier = parsed.slo_tier or checked_tier(req.headers.get(TIER_HEADER), f"header {TIER_HEADER}")
    job.priority = parsed.priority or checked_priority(req.headers.get(PRIORITY_HEADER), f"header {PRIORITY_HEADER}")


class _ChatShape:
    """chat.completion / chat.completion.chunk bodies of one choice (`index`) of a request.
    `lps`: (token id, TokenLogprobs) pairs, shown when the request asked for logprobs."""

    def __init__(self, chat: oa.ChatRequest, tokenizer, index: int = 0):
        self.r, self.tok, self.want, self.i = chat, tokenizer, chat.sampling.logprobs is not None, index
        self.calls = None if chat.tools is None else ToolCallStream()  # tool calls parsed as they stream

    def opening(self, created: int) -> dict:
        return oa.chunk_json(self.r, created, {"role": "assistant", "content": ""}, None, index=self.i)

    def chunk(self, created: int, text: str, finish: str | None, lps) -> dict:
        delta: dict = {"content": text}
        if self.calls is not None:
            delta["content"] = self.calls.feed(text) + (self.calls.flush() if finish is not None else "")
            new = self.calls.take()
            if new:
                delta["tool_calls"] = new
            if finish == "stop" and self.calls.calls:
                finish = "tool_calls"
        return oa.chunk_json(self.r, created, delta, finish,
                             oa.chat_logprobs(lps, self.tok) if self.want else None, self.i)

    def whole(self, text: str, finish: str, usage: dict, lps) -> dict:
        return oa.completion_json(self.r, text, finish, usage, oa.chat_logprobs(lps, self.tok) if self.want else None,
                                  self.i)


class _TextShape:
    """text_completion bodies of one choice (`index`) of a /v1/completions request (no opening event)."""

    def __init__(self, comp: oa.CompletionRequest, tokenizer, index: int = 0):
        self.r, self.tok, self.want, self.i = comp, tokenizer, comp.sampling.logprobs is not None, index
        self.offset = 0  # characters of text sent so far (text_offset of streamed logprobs)

    def opening(self, created: int) -> None:
        return None

    def chunk(self, created: int, text: str, finish: str | None, lps) -> dict:
        lp = oa.text_logprobs(lps, self.tok, self.offset) if self.want else None
        self.offset += len(text)
        return oa.text_chunk_json(self.r, created, text, finish, lp, self.i)

    def whole(self, text: str, finish: str, usage: dict, lps) -> dict:
        return oa.text_completion_json(self.r, text, finish, usage,
                                       oa.text_logprobs(lps, self.tok) if self.want else None, self.i)
