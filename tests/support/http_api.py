"""The gateway's HTTP API (HttpApi on an aiohttp test server) with dead upstreams, and a JSON POST to it."""
from __future__ import annotations

import json

SERVED = "tiny"
DEAD = "127.0.0.1:1"  # nothing listens here: a valid body ends in 503, never a hang


CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def http_client(loop, adapter, core_cls, **flags):
    """An aiohttp test client of HttpApi(core_cls(...)) on 127.0.0.1 (yields it, then closes);
    `flags`: more GatewayConfig fields."""
    from aiohttp.test_utils import TestClient, TestServer

    from easerve.stages.gateway.core import GatewayConfig
    from easerve.stages.gateway.http_api import HttpApi
    from easerve.stages.gateway.metrics import GatewayMetrics

    cfg = GatewayConfig(model=adapter.path, served_model_name=SERVED, encode=(DEAD,), prefill=(DEAD,), decode=(DEAD,),
                        max_model_len=256, **flags)

    async def start():  # gRPC channels bind to the running loop
        api = HttpApi(core_cls(cfg, adapter, GatewayMetrics()), 1 << 20, lambda: True)
        c = TestClient(TestServer(api.app, host="127.0.0.1"), loop=loop)
        await c.start_server()
        return c

    c = loop.run_until_complete(start())
    yield c
    loop.run_until_complete(c.close())


def post(loop, client, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
    async def go():
        data = raw if raw is not None else json.dumps(body).encode()
        async with client.post(path, data=data, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.json(content_type=None)
    return loop.run_until_complete(go())
