"""OpenAI-compatible HTTP front of the gateway (aiohttp).

POST /v1/chat/completions (stream: true -> SSE ending in [DONE]), GET /v1/models,
GET /health, GET /metrics. Errors: 400 with what to change, 429 on overload,
503 when a stage is unavailable, 504 past the deadline; the server keeps serving.
"""
from __future__ import annotations

import json
import time

from aiohttp import web

from easerve.rpc.errors import http_status
from services.gateway import openai_api as oa
from services.gateway.core import GatewayCore, Job


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return web.json_response(oa.error_json(message, kind, status), status=status)


class HttpApi:
    def __init__(self, core: GatewayCore, max_body_bytes: int, ready):
        self.core, self.ready = core, ready
        self.app = web.Application(client_max_size=max_body_bytes)
        self.app.add_routes([web.post("/v1/chat/completions", self.chat), web.get("/v1/models", self.models),
                             web.get("/health", self.health), web.get("/metrics", self.metrics)])

    async def health(self, _req: web.Request) -> web.Response:
        return web.json_response({"status": "ok"}) if self.ready() else _error(503, "warming up")

    async def metrics(self, _req: web.Request) -> web.Response:
        return web.Response(text=self.core.m.render(), content_type="text/plain", charset="utf-8")

    async def models(self, _req: web.Request) -> web.Response:
        return web.json_response(oa.models_json(self.core.cfg.served_model, self.core.max_model_len, self.core.started))

    async def _body(self, req: web.Request) -> dict:
        try:
            raw = await req.read()
        except web.HTTPRequestEntityTooLarge:
            raise oa.BadRequest(f"request body over {req.app._client_max_size} bytes; send smaller media") from None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise oa.BadRequest(f"request body is not valid JSON: {e}") from None

    async def chat(self, req: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(req)
            a = self.core.adapter
            chat = oa.parse_chat_request(body, self.core.cfg.served_model, a.modalities, a.sampling_rate,
                                         self.core.cfg.default_max_tokens)
        except oa.BadRequest as e:
            self.core.m.requests.inc(api="http", code="400")
            return _error(400, str(e))
        job = Job(chat.sampling, chat.request_id, messages=chat.messages, timeout_s=chat.timeout_s)
        if chat.stream:
            return await self._stream(req, chat, job)
        return await self._unary(chat, job)

    async def _unary(self, chat: oa.ChatRequest, job: Job) -> web.Response:
        text, last = [], None
        try:
            async for d in self.core.generate(job):
                text.append(d.text)
                last = d
        except Exception as e:  # noqa: BLE001 - mapped to a status, server keeps serving
            return self._fail(e)
        self.core.m.requests.inc(api="http", code="200")
        return web.json_response(oa.completion_json(chat, "".join(text), last.finish_reason,
                                                    last.prompt_tokens, last.completion_tokens))

    def _fail(self, e: Exception) -> web.Response:
        status = http_status(e)
        self.core.m.requests.inc(api="http", code=str(status))
        return _error(status, str(e) or type(e).__name__)

    async def _stream(self, req: web.Request, chat: oa.ChatRequest, job: Job) -> web.StreamResponse:
        gen = self.core.generate(job)
        created = int(time.time())
        try:  # fail before the 200 header when the request is bad or the pipeline refuses it
            first = await gen.__anext__()
        except Exception as e:  # noqa: BLE001
            return self._fail(e)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(req)
        await self._sse(resp, oa.chunk_json(chat, created, {"role": "assistant", "content": ""}, None))
        try:
            d = first
            while True:
                await self._sse(resp, oa.chunk_json(chat, created, {"content": d.text}, d.finish_reason))
                if d.finish_reason is not None:
                    break
                d = await gen.__anext__()
            if chat.include_usage:
                usage = oa.usage_json(d.prompt_tokens, d.completion_tokens)
                await self._sse(resp, {**oa.chunk_json(chat, created, {}, None), "choices": [], "usage": usage})
            self.core.m.requests.inc(api="http", code="200")
        except (ConnectionResetError, StopAsyncIteration):
            pass
        except Exception as e:  # noqa: BLE001 - headers are out: report in-band
            await self._sse(resp, oa.error_json(str(e) or type(e).__name__, "server_error", http_status(e)))
        finally:
            await gen.aclose()  # client gone or done: cancels every stage's work
        try:
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            pass
        return resp

    @staticmethod
    async def _sse(resp: web.StreamResponse, obj: dict) -> None:
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
