"""Overload and dead stages on a live stack: RESOURCE_EXHAUSTED / 429 when decode's
admission queue is full, UNAVAILABLE / 503 within the deadline when a stage is down."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from easerve import Client
from easerve.errors import Overloaded, Unavailable
from easerve.models.tiny import cached_tiny
from hasctl.deployment import preset
from hasctl.launch import Stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_stack(tiny_root):
    """One KV slot and no waiting room in decode; stages are not restarted when killed."""
    model = str(cached_tiny("qwen2.5-vl", tiny_root))
    d = (preset("default").with_model(model).with_gateway_ports(0, 0)
         .with_flags("decode", num_slots=1, max_waiting=0, max_seq_len=4096, threads=1))
    stack = Stack(d, restart=False, env={"EASERVE_LOG_LEVEL": "WARNING"})
    stack.start(timeout=420)
    yield stack
    stack.stop()


def test_overload_is_resource_exhausted_then_recovers(small_stack):
    client = Client(small_stack.endpoints.grpc, timeout=120)
    long = client.generate("Count forever", max_tokens=3000, stream=True)
    it = iter(long)
    for _ in range(3):  # past prefill's first token: decode has admitted it, the one slot is taken
        next(it)
    with pytest.raises(Overloaded) as over:
        client.generate("me too", max_tokens=4)
    assert over.value.retry_after_s == 1.0  # the retry hint (retry-after-ms)
    body = json.dumps({"messages": [{"role": "user", "content": "me too"}], "max_tokens": 4}).encode()
    req = urllib.request.Request(small_stack.endpoints.http + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 429
    assert int(e.value.headers["Retry-After"]) >= 1
    stream_body = json.dumps({"messages": [{"role": "user", "content": "me too"}], "max_tokens": 4,
                              "stream": True}).encode()
    req = urllib.request.Request(small_stack.endpoints.http + "/v1/chat/completions", data=stream_body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:  # refused before prefill: a real 429, not an in-band error
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 429
    long.close()
    deadline = time.monotonic() + 20
    while True:  # the slot frees once the cancel has reached decode
        try:
            assert client.generate("now it fits", max_tokens=3).usage.completion_tokens >= 1
            break
        except Overloaded:
            assert time.monotonic() < deadline, "the cancelled request never left decode"
            time.sleep(0.1)


def test_dead_decode_is_unavailable_within_the_deadline(small_stack):
    client = Client(small_stack.endpoints.grpc, timeout=30)
    assert client.generate("alive?", max_tokens=2).usage.completion_tokens >= 1
    small_stack._procs["decode-0"].popen.kill()
    small_stack._procs["decode-0"].popen.wait()
    t0 = time.monotonic()
    with pytest.raises(Unavailable):
        client.generate("anyone there?", max_tokens=4, timeout=20)
    assert time.monotonic() - t0 < 20
    out: list = []
    t = threading.Thread(target=lambda: out.append(_http_status(small_stack)))
    t.start()
    t.join(30)
    assert out == [503]


def _http_status(stack) -> int:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    req = urllib.request.Request(stack.endpoints.http + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=25).status
    except urllib.error.HTTPError as e:
        return e.code
