"""A fake OpenAI-compatible chat server with known delays, and its own record of the truth.

Run as a process: `python -m tests.support.fake_openai` prints `PORT <n>` once it listens on
127.0.0.1 (a free port). Each streamed /v1/chat/completions request is put in a class by
crc32 of its last text part (so a test can predict the class of a request it synthesized):

  crc % 8 in 0..4  -> fast:  first token after FAST_TTFT_S, then one token every FAST_ITL_S
  crc % 8 in 5..6  -> slow:  SLOW_TTFT_S, then SLOW_ITL_S
  crc % 8 == 7     -> 429 before any header

It streams max_tokens one-word content chunks, then a usage chunk, then [DONE]. GET /truth
returns, per request in arrival order, the class, the server-side TTFT and TPOT measured on
its own clock around its own writes, and the token count.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
import zlib

from aiohttp import web

FAST_TTFT_S, FAST_ITL_S = 0.050, 0.010
SLOW_TTFT_S, SLOW_ITL_S = 0.200, 0.030


def request_class(text: str) -> str:
    c = zlib.crc32(text.encode()) % 8
    return "fast" if c <= 4 else ("slow" if c <= 6 else "reject")


def _last_text(body: dict) -> str:
    content = body["messages"][-1]["content"]
    if isinstance(content, str):
        return content
    return [p["text"] for p in content if p.get("type") == "text"][-1]


class Fake:
    def __init__(self) -> None:
        self.truth: list[dict] = []

    async def models(self, _req: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def get_truth(self, _req: web.Request) -> web.Response:
        return web.json_response(self.truth)

    async def chat(self, req: web.Request) -> web.StreamResponse:
        t_recv = time.monotonic()
        body = await req.json()
        text = _last_text(body)
        kind = request_class(text)
        rec = {"text": text, "class": kind, "recv_s": t_recv, "end_s": t_recv}
        self.truth.append(rec)
        if kind == "reject":
            return web.json_response({"error": {"message": "queue full", "code": 429}}, status=429)
        ttft, itl = (FAST_TTFT_S, FAST_ITL_S) if kind == "fast" else (SLOW_TTFT_S, SLOW_ITL_S)
        n = int(body.get("max_tokens", 16))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        await asyncio.sleep(max(0.0, t_recv + ttft - time.monotonic()))
        writes = []
        for i in range(n):
            if i:
                await asyncio.sleep(max(0.0, writes[-1] + itl - time.monotonic()))
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            writes.append(time.monotonic())
        usage = {"object": "chat.completion.chunk", "choices": [],
                 "usage": {"prompt_tokens": len(text.split()), "completion_tokens": n, "total_tokens": n}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        rec |= {"ttft_s": writes[0] - t_recv, "tpot_s": (writes[-1] - writes[0]) / (n - 1) if n > 1 else None,
                "tokens": n, "end_s": time.monotonic()}
        return resp


async def main() -> None:
    fake = Fake()
    app = web.Application()
    app.add_routes([web.get("/v1/models", fake.models), web.get("/truth", fake.get_truth),
                    web.post("/v1/chat/completions", fake.chat)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    print(f"PORT {port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
