"""No swallowed errors.

- An internal `ValueError` (a bug here) is HTTP 500 / gRPC INTERNAL with its traceback in the
  log, never a 400 blaming the client; an `InvalidRequest` (bad media) stays a 400 /
  INVALID_ARGUMENT. The gateway's real HTTP and gRPC fronts over a real GatewayCore and tiny
  processor; the bug is injected by an adapter whose `preprocess` raises ValueError.
- A transport's receive thread that dies fails every pending and later transfer at once
  (Unavailable), instead of leaving them to wait out their timeouts: the NCCL transport over
  gloo between two real processes, its thread killed for real by SIGKILLing the sending peer.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import time

import grpc
import pytest


SERVED = "tiny"
DEAD = "127.0.0.1:1"  # nothing listens: the bug surfaces before any stage is called


class BuggyAdapter:
    """The real tiny processor adapter, except that chat preprocessing hits an internal bug."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def preprocess(self, messages, add_generation_prompt: bool = True):
        raise ValueError("list.index(x): x not in list")  # what a bug in our own code raises


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from easerve.models.loader import load_adapter
    from easerve.models.tiny import cached_tiny

    root = os.environ.get("EASERVE_TINY_CACHE") or tmp_path_factory.mktemp("tiny")
    return BuggyAdapter(load_adapter(cached_tiny("qwen2.5-vl", root), role="processor"))


def _core(adapter):
    from easerve.stages.gateway.core import GatewayConfig, GatewayCore
    from easerve.stages.gateway.metrics import GatewayMetrics
    cfg = GatewayConfig(model=adapter.path, served_model_name=SERVED, encode=(DEAD,), prefill=(DEAD,), decode=(DEAD,),
                        max_model_len=256)
    return GatewayCore(cfg, adapter, GatewayMetrics())


CHAT = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD_IMAGE = {"model": SERVED, "max_tokens": 2, "messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"\x89PNG").decode()}}]}]}


def _bug_logged(caplog) -> bool:
    return any(r.levelno >= logging.ERROR and r.exc_info and r.exc_info[0] is ValueError for r in caplog.records)


def test_internal_value_error_is_500_with_a_log_line_over_http(adapter, caplog):
    from aiohttp.test_utils import TestClient, TestServer

    from easerve.stages.gateway.http_api import HttpApi

    async def main():
        api = HttpApi(_core(adapter), 1 << 20, lambda: True)
        async with TestClient(TestServer(api.app, host="127.0.0.1")) as c:
            out = {}
            for name, body in (("bug", CHAT), ("bug-stream", {**CHAT, "stream": True}), ("client", BAD_IMAGE)):
                async with c.post("/v1/chat/completions", data=json.dumps(body)) as r:
                    out[name] = (r.status, await r.json(content_type=None))
            return out

    with caplog.at_level(logging.ERROR):
        out = asyncio.run(main())
    for name in ("bug", "bug-stream"):
        status, body = out[name]
        assert status == 500 and body["error"]["type"] == "server_error", out[name]
        assert "internal error (ValueError)" in body["error"]["message"]
        assert "x not in list" not in body["error"]["message"]  # the bug's details stay in the log
    assert _bug_logged(caplog)
    status, body = out["client"]
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "image" in body["error"]["message"]


def test_internal_value_error_is_internal_with_a_log_line_over_grpc(adapter, caplog):
    from easerve.rpc.server import serve
    from easerve.wire.v1 import gateway_pb2 as gpb
    from easerve.wire.v1 import gateway_pb2_grpc
    from easerve.stages.gateway.servicer import GatewayServicer

    async def main():
        stop, port = asyncio.Event(), asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve([(gateway_pb2_grpc.add_GatewayServicer_to_server, GatewayServicer(_core(adapter)))],
                                         "127.0.0.1:0", stop=stop, on_bound=port.set_result))
        out = {}
        async with grpc.aio.insecure_channel(f"127.0.0.1:{await port}") as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            msg = gpb.ChatMessage(role="user", content=[gpb.ContentPart(text="hi")])
            bad = gpb.ChatMessage(role="user", content=[gpb.ContentPart(image=gpb.ImageInput(data=b"\x89PNG"))])
            for name, req in (("bug", gpb.GenerateRequest(messages=[msg])), ("client", gpb.GenerateRequest(messages=[bad]))):
                try:
                    [m async for m in stub.Generate(req, timeout=30)]
                except grpc.aio.AioRpcError as e:
                    out[name] = (e.code(), e.details())
        stop.set()
        await task
        return out

    with caplog.at_level(logging.ERROR):
        out = asyncio.run(main())
    assert out["bug"][0] == grpc.StatusCode.INTERNAL and "ValueError" in out["bug"][1], out
    assert "x not in list" not in out["bug"][1]
    assert _bug_logged(caplog)
    assert out["client"][0] == grpc.StatusCode.INVALID_ARGUMENT and "image" in out["client"][1], out


# ---- a transport thread that dies ---------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sender(init: str, conn) -> None:
    from easerve.transport.nccl import NcclConfig, NcclTransport

    async def main():
        t = NcclTransport(NcclConfig(rank=0, init_method=init, backend="gloo", device="cpu", connect_timeout_s=60))
        await t.connect()
        conn.send("connected")
        conn.recv()  # until SIGKILLed
    asyncio.run(main())


def _receiver(init: str, conn) -> None:
    """Waits for a payload that never comes while its peer is killed; reports both recvs."""
    from easerve.errors import EAServeError
    from easerve.transport.handles import NcclHandle
    from easerve.transport.nccl import NcclConfig, NcclTransport

    async def recv(t, tag):
        t0 = time.monotonic()
        try:
            await t.recv(NcclHandle(f"r{tag}", 0, 1, tag, 0), timeout=90)
            return ("ok", "", time.monotonic() - t0)
        except EAServeError as e:
            return (type(e).__name__, str(e), time.monotonic() - t0)

    async def main():
        t = NcclTransport(NcclConfig(rank=1, init_method=init, backend="gloo", device="cpu", connect_timeout_s=60))
        await t.connect()
        conn.send("connected")
        pending = asyncio.ensure_future(recv(t, 7))
        await asyncio.sleep(0.5)
        conn.send("waiting")
        first = await pending
        conn.send((first, await recv(t, 8), t._drainer.is_alive()))
    asyncio.run(main())


@pytest.mark.slow
def test_dying_transport_thread_fails_pending_and_later_transfers():
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{_free_port()}"
    (s_parent, s_child), (r_parent, r_child) = ctx.Pipe(), ctx.Pipe()
    sender = ctx.Process(target=_sender, args=(init, s_child), daemon=True)
    receiver = ctx.Process(target=_receiver, args=(init, r_child), daemon=True)
    sender.start()
    receiver.start()
    try:
        assert s_parent.poll(120) and s_parent.recv() == "connected"
        assert r_parent.poll(120) and r_parent.recv() == "connected"
        assert r_parent.poll(30) and r_parent.recv() == "waiting"
        os.kill(sender.pid, signal.SIGKILL)  # the peer dies: the receive thread's recv breaks
        assert r_parent.poll(60), "the pending transfer is still waiting (its timeout is 90 s)"
        first, later, alive = r_parent.recv()
    finally:
        for p in (sender, receiver):
            if p.is_alive():
                p.kill()
            p.join(10)
    assert first[0] == "Unavailable" and "receive thread stopped" in first[1] and first[2] < 60, first
    assert later[0] == "Unavailable" and later[2] < 1.0, later  # no wait at all once it is gone
    assert not alive


def test_a_client_cannot_set_the_gateways_resumed_tokens(adapter):
    """sampling.resumed is the gateway's own (mid-stream migration): INVALID_ARGUMENT from a client."""
    from easerve.errors import InvalidRequest
    from easerve.stages.gateway.servicer import GatewayServicer
    from easerve.wire.v1 import common_pb2 as cpb
    from easerve.wire.v1 import gateway_pb2 as gpb

    async def main():
        servicer = GatewayServicer(_core(adapter))
        ok = servicer._job(gpb.GenerateRequest(prompt="hi", sampling=cpb.SamplingParams(max_tokens=4)), None)
        assert ok.sampling.resumed == ()
        with pytest.raises(InvalidRequest, match="sampling.resumed is the gateway's own"):
            servicer._job(gpb.GenerateRequest(prompt="hi", sampling=cpb.SamplingParams(max_tokens=4, resumed=[1])),
                          None)

    asyncio.run(main())
