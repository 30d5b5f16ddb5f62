"""1,000 requests cancelled at random points through a live stack (gateway, encode, remote
prefill, decode; the KV over shm): afterwards decode's free KV capacity (Stage.Load), every
stage's in-flight count, the bytes prefill's shm sender still holds (slab regions decode has
not let go of, easerve:kv_sender_held_bytes), every process's shared-memory mappings and the
/dev/shm segments of the stack are back to their values before the storm, and the stack still serves.

Cancel points: before the first token (at a random delay after sending, so somewhere in
gateway, encode, prefill or the KV handoff), right after the first token (decode has just
taken the KV), and mid-decode (after a few tokens). One request in eight carries an image
(encode -> remote prefill with the embeddings).
"""
from __future__ import annotations

import asyncio
import os
import random
import time

import grpc
import pytest

from easerve.client import AsyncClient, Client
from easerve.errors import Cancelled
from easerve.models.tiny import cached_tiny
from easerve.wire.v1 import stage_pb2, stage_pb2_grpc
from hasctl.deployment import preset
from hasctl.launch import Stack, free_port
from tests.support.media import png_bytes
from tests.support.prom import metric, scrape

pytestmark = [pytest.mark.slow, pytest.mark.load]  # 1,000 requests: a long load test
N_REQUESTS = 1000
CONCURRENCY = 24
SHM_PREFIX = "easerve"


def load(addr: str) -> stage_pb2.LoadResponse:
    with grpc.insecure_channel(addr) as ch:
        return stage_pb2_grpc.StageStub(ch).Load(stage_pb2.LoadRequest(), timeout=10)


def shm_mapped(pid: int) -> dict[str, int]:
    """Bytes of each of our shm segments `pid` maps (deleted one-offs included)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(f"/dev/shm/{SHM_PREFIX}"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out[parts[5].strip()] = out.get(parts[5].strip(), 0) + hi - lo
    return out


def shm_segments() -> dict[str, int]:
    return {n: os.stat(f"/dev/shm/{n}").st_size for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)}


def kv_held(metrics_url: str) -> float:
    """Prefill's easerve:kv_sender_held_bytes: slab regions decode has not let go of."""
    return metric(scrape(metrics_url), "easerve:kv_sender_held_bytes")


def snapshot(stack: Stack) -> dict:
    stages = {n: a for n, a in stack.endpoints.stages.items() if n != "gateway"}
    loads = {n: load(a) for n, a in stages.items()}
    return {"kv_free": loads["decode-0"].kv_free_tokens, "kv_total": loads["decode-0"].kv_total_tokens,
            "prefill_kv_held": kv_held(stack.prefill_metrics),
            "inflight": {n: ld.inflight for n, ld in loads.items()},
            "mapped": {n: shm_mapped(pid) for n, pid in stack.pids.items()},
            "segments": {n: s for n, s in shm_segments().items() if n in _stack_segments(stack)}}


def _stack_segments(stack: Stack) -> set[str]:
    """Our segments some process of this stack maps (other tests' segments left alone)."""
    return {os.path.basename(p) for pid in stack.pids.values() for p in shm_mapped(pid)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = os.environ.get("EASERVE_TINY_CACHE") or str(tmp_path_factory.mktemp("tiny"))
    model = str(cached_tiny("qwen2.5-vl", root))
    metrics = f"127.0.0.1:{free_port()}"
    d = (preset("default").with_model(model).with_gateway_ports(0, 0)
         .with_flags("decode", threads=1, num_slots=16, max_seq_len=1024)
         .with_flags("prefill", threads=1, kv_transport="shm", metrics_listen=metrics).with_flags("encode", threads=1))
    s = Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"})
    s.prefill_metrics = f"http://{metrics}/metrics"
    s.start(timeout=420)
    yield s
    s.stop()


async def one(client: AsyncClient, rng: random.Random, image: bytes, counts: dict) -> None:
    point = rng.choice(["before_first", "after_first", "mid_decode"])
    kw = {"images": [image]} if rng.random() < 1 / 8 else {}
    stream = await client.generate("Tell me a long story about", max_tokens=200, ignore_eos=True,
                                   stream=True, timeout=60, **kw)
    try:
        if point == "before_first":
            read = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(rng.uniform(0, 0.05))
            if not read.done():
                read.cancel()
                await asyncio.gather(read, return_exceptions=True)
        else:
            want = 1 if point == "after_first" else rng.randint(2, 12)
            got = 0
            async for chunk in stream:
                got += len(chunk.token_ids)
                if got >= want:
                    break
        counts[point] += 1
    except Cancelled:
        counts[point] += 1
    finally:
        stream.close()


async def storm(addr: str, image: bytes) -> dict:
    rng, counts = random.Random(7), {"before_first": 0, "after_first": 0, "mid_decode": 0}
    sem = asyncio.Semaphore(CONCURRENCY)
    async with AsyncClient(addr) as client:
        async def guarded():
            async with sem:
                await one(client, rng, image, counts)
        await asyncio.gather(*(guarded() for _ in range(N_REQUESTS)))
    return counts


def wait_back(stack: Stack, start: dict, timeout: float = 60.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        now = snapshot(stack)
        if now == start or time.monotonic() > end:
            return now
        time.sleep(0.5)


def test_thousand_cancelled_requests_leave_nothing_held(stack):
    image = png_bytes(56, 56, seed=1)
    with Client(stack.endpoints.grpc, timeout=120) as c:  # warm: the slab exists
        assert c.generate("hi", max_tokens=4).text is not None
        assert c.generate("what is this", images=[image], max_tokens=4).text is not None
    start = wait_back(stack, {}, timeout=2)
    assert start["kv_free"] == start["kv_total"] > 0 and not any(start["inflight"].values())
    assert start["prefill_kv_held"] == 0
    assert any(start["mapped"].values()), "no process maps a shm segment: the KV did not go over shm"

    t0 = time.monotonic()
    counts = asyncio.run(storm(stack.endpoints.grpc, image))
    storm_s = time.monotonic() - t0
    assert sum(counts.values()) == N_REQUESTS and min(counts.values()) > 100, counts
    assert stack.restarts == {n: 0 for n in stack.restarts}, "a stage died during the storm"

    after = wait_back(stack, start)
    assert after["kv_free"] == start["kv_free"], f"decode KV free {after['kv_free']} != {start['kv_free']}"
    assert after["prefill_kv_held"] == 0, "prefill's shm slab still holds KV regions"
    assert after["inflight"] == start["inflight"]
    assert after["mapped"] == start["mapped"], "a process's shm mappings changed"
    assert after["segments"] == start["segments"], "/dev/shm segments changed"
    with Client(stack.endpoints.grpc, timeout=120) as c:
        out = c.generate("still there?", max_tokens=8, ignore_eos=True)
    assert out.usage.completion_tokens == 8
    print(f"\ncancel storm: {N_REQUESTS} requests in {storm_s:.1f} s, {counts}; decode KV free "
          f"{after['kv_free']}/{after['kv_total']} tokens; shm mapped "
          f"{ {n: sum(m.values()) for n, m in after['mapped'].items()} } bytes")
