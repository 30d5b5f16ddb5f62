"""5x the measured capacity for 60 s on a live stack with bounded queues: the surplus is
refused at once with 429 + Retry-After (HTTP) and RESOURCE_EXHAUSTED + `retry-after-ms`
(gRPC); every process's RSS stays under its pre-overload RSS + RSS_HEADROOM_MIB; goodput
recovers afterwards. Then a drain: on SIGTERM the gateway's HTTP side refuses new requests
(503 + Retry-After, as the README promises) while the one in flight finishes.
Figures: docs/reliability/faults.md."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import grpc
import pytest

from easerve.client_request import build_request
from easerve.models.tiny import cached_tiny
from easerve.rpc.errors import RETRY_AFTER_KEY
from easerve.wire.v1 import gateway_pb2_grpc
from hasctl.deployment import preset
from hasctl.launch import Stack
from tests.reliability.driver import HUNG, REFUSED, LoadDriver, image_bodies, rss_kib, served_model

pytestmark = [pytest.mark.slow, pytest.mark.load]

OVERLOAD_X, OVERLOAD_S, DEADLINE_S = 5.0, 60.0, 10.0
RSS_HEADROOM_MIB = 256  # the stated bound: no process grows past its pre-overload RSS + this
GATEWAY_INFLIGHT, DECODE_WAITING = 16, 8  # the bounded queues under test
FIGURES = os.environ.get("EASERVE_FAULT_FIGURES")


@pytest.fixture(scope="module")
def stack(tiny_root):
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    d = (preset("default").with_model(model).with_gateway_ports(0, 0)
         .with_flags("gateway", max_inflight=GATEWAY_INFLIGHT)
         .with_flags("decode", max_seq_len=1024, max_waiting=DECODE_WAITING, threads=1)
         .with_flags("prefill", threads=1).with_flags("encode", threads=1))
    s = Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"})
    s.start(timeout=420)
    yield s
    s.stop()


async def _sample_rss(pids: dict[str, int], peak: dict[str, int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for name, pid in pids.items():
            kib = rss_kib(pid)
            if kib is not None:
                peak[name] = max(peak.get(name, 0), kib)
        await asyncio.sleep(0.5)


async def _grpc_refusals(addr: str, n: int) -> list[tuple[str, str | None]]:
    """(status code name, retry-after-ms) of n concurrent gRPC requests sent at once."""
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        async def one(i: int):
            call = stub.Generate(build_request(f"overload {i}", max_tokens=64, ignore_eos=True), timeout=DEADLINE_S)
            try:
                async for _ in call:
                    pass
                return "OK", None
            except grpc.aio.AioRpcError as e:
                meta = dict(e.trailing_metadata() or ())
                return e.code().name, meta.get(RETRY_AFTER_KEY)
        return await asyncio.gather(*(one(i) for i in range(n)))


async def _overload(stack: Stack) -> dict:
    url = stack.endpoints.http
    model = await served_model(url)
    async with LoadDriver(url, image_bodies(model, 64, seed=1, max_tokens=16), deadline_s=DEADLINE_S) as probe:
        capacity = await probe.run_closed(concurrency=4, duration_s=10.0)
    pids = {n: p for n, p in stack.pids.items() if p}
    start_rss = {n: rss_kib(p) for n, p in pids.items()}
    rate = OVERLOAD_X * capacity
    bodies = image_bodies(model, int(rate * OVERLOAD_S) + 1, seed=2, max_tokens=16)
    peak: dict[str, int] = {}
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(_sample_rss(pids, peak, stop))
    async with LoadDriver(url, bodies, deadline_s=DEADLINE_S) as drv:
        load = asyncio.ensure_future(drv.run(rate, OVERLOAD_S))
        await asyncio.sleep(OVERLOAD_S / 2)
        grpc_out = await _grpc_refusals(stack.endpoints.grpc, 3 * GATEWAY_INFLIGHT)
        await load
    stop.set()
    await sampler
    await asyncio.sleep(2.0)
    after_rate = 0.5 * capacity
    async with LoadDriver(url, image_bodies(model, 64, seed=3, max_tokens=16), deadline_s=DEADLINE_S) as rec:
        await rec.run(after_rate, 20.0)
    return {"capacity": capacity, "rate": rate, "drv": drv, "grpc": grpc_out, "start_rss": start_rss,
            "peak_rss": peak, "after": rec, "after_rate": after_rate}


def test_five_times_capacity_is_refused_with_retry_after_and_memory_stays_bounded(stack):
    r = asyncio.run(_overload(stack))
    drv, t = r["drv"], r["drv"].tally()
    after = r["after"].tally()
    grpc_codes = {c for c, _ in r["grpc"]}
    growth = {n: (r["peak_rss"].get(n, 0) - (r["start_rss"][n] or 0)) / 1024 for n in r["start_rss"]}
    _record(r, t, after, growth)
    assert r["capacity"] > 0.2, f"the capacity probe completed almost nothing: {r['capacity']:.2f}/s"
    assert t.sent == t.completed + t.errored == len(drv.outcomes), t
    assert t.by_status.get(429, 0) > 0, f"no 429 at {OVERLOAD_X}x capacity: {t}"
    assert all(o.retry_after and int(o.retry_after) >= 1 for o in drv.outcomes if o.status == 429), \
        "a 429 without a Retry-After of whole seconds"
    unclear = {k: v for k, v in t.by_status.items() if k not in (200, 429, 504)}
    assert not unclear, f"answers other than 200 / 429 / 504 (or none: {HUNG}, {REFUSED}): {t}"
    assert t.completed > 0, t
    assert "RESOURCE_EXHAUSTED" in grpc_codes, f"no RESOURCE_EXHAUSTED over gRPC: {r['grpc']}"
    assert grpc_codes <= {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, r["grpc"]
    assert all(int(ms) >= 1 for c, ms in r["grpc"] if c == "RESOURCE_EXHAUSTED"), r["grpc"]
    too_big = {n: round(g) for n, g in growth.items() if g > RSS_HEADROOM_MIB}
    assert not too_big, f"RSS grew past start + {RSS_HEADROOM_MIB} MiB: {too_big}"
    assert after.completed >= 0.9 * after.sent, f"goodput did not recover after the overload: {after}"


def _record(r, t, after, growth) -> None:
    line = {"overload": {"capacity_rps": round(r["capacity"], 2), "offered_rps": round(r["rate"], 2),
                         "duration_s": OVERLOAD_S, "deadline_s": DEADLINE_S,
                         "gateway_max_inflight": GATEWAY_INFLIGHT, "decode_max_waiting": DECODE_WAITING,
                         "sent": t.sent, "completed": t.completed,
                         "by_status": {str(k): v for k, v in t.by_status.items()},
                         "grpc": {c: sum(1 for x, _ in r["grpc"] if x == c) for c in {c for c, _ in r["grpc"]}},
                         "rss_start_mib": {n: round((v or 0) / 1024) for n, v in r["start_rss"].items()},
                         "rss_growth_mib": {n: round(g) for n, g in growth.items()},
                         "rss_bound": f"start + {RSS_HEADROOM_MIB} MiB",
                         "after": {"rate_rps": round(r["after_rate"], 2), "sent": after.sent,
                                   "completed": after.completed}}}
    print("OVERLOAD", json.dumps(line))
    if FIGURES:
        with open(FIGURES, "a") as f:
            f.write(json.dumps(line) + "\n")


def test_drain_refuses_new_http_requests_and_finishes_the_one_in_flight(stack):
    stack.wait_healthy(120)
    asyncio.run(_drain(stack))
    end = time.monotonic() + 120
    while stack.restarts["gateway"] == 0:  # it exited after draining; the launcher brings it back
        assert time.monotonic() < end, "the gateway was not restarted after its drain"
        time.sleep(0.2)
    stack.wait_healthy(120)


async def _drain(stack: Stack) -> None:
    url = stack.endpoints.http + "/v1/chat/completions"
    model = await served_model(stack.endpoints.http)
    long = {"model": model, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 400,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    short = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(url, json=long) as resp:
            assert resp.status == 200
            events = [await resp.content.readline()]  # in flight: its first event is here
            os.kill(stack.pids["gateway"], signal.SIGTERM)
            await asyncio.sleep(0.5)
            refused = await _status_of(url, short)
            assert refused[0] == 503, f"a new request during the drain got {refused}, not 503"
            assert refused[1] and int(refused[1]) >= 1, "the drain's 503 has no Retry-After"
            async for line in resp.content:
                events.append(line)
    data = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    lines = [e for e in events if e.strip()]
    # the request in flight ran to the end of a normal stream: one [DONE], last, after all 400 tokens
    assert lines[-1] == b"data: [DONE]\n" and lines.count(b"data: [DONE]\n") == 1, lines[-3:]
    assert [c["finish_reason"] for d in data for c in d["choices"] if c.get("finish_reason")] == ["length"]
    assert [d["usage"]["completion_tokens"] for d in data if d.get("usage")] == [400]
    assert not any("error" in d for d in data)


async def _status_of(url: str, body: dict) -> tuple:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.post(url, json=body) as r:
                return r.status, r.headers.get("Retry-After")
    except aiohttp.ClientConnectionError:
        return REFUSED, None
