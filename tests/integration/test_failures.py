"""Failure cases on a live stack: client cancel frees decode's work and KV; bad input
gets 400 / INVALID_ARGUMENT with a message and the stack keeps serving."""
from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from easerve import Client
from easerve.wire.v1 import decode_pb2, decode_pb2_grpc
from tests.support.media import data_uri, png_bytes, wav_bytes

pytestmark = pytest.mark.slow


def decode_stats(stack):
    with grpc.insecure_channel(stack.endpoints.stages["decode-0"]) as ch:
        return decode_pb2_grpc.DecodeStub(ch).Stats(decode_pb2.StatsRequest(), timeout=10)


def wait_for(pred, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    return pred()


def test_cancel_mid_stream_frees_decode_work_and_kv(vl_stack):
    idle = decode_stats(vl_stack)
    assert idle.running == 0
    client = Client(vl_stack.endpoints.grpc, timeout=120)
    stream = client.generate("Count forever", max_tokens=3000, stream=True)
    seen = 0
    for chunk in stream:
        seen += len(chunk.token_ids)
        if seen >= 5:
            break
    busy = decode_stats(vl_stack)
    assert busy.running == 1 and busy.kv_free_tokens < idle.kv_free_tokens
    stream.close()
    freed = wait_for(lambda: (s := decode_stats(vl_stack)).running == 0 and s.kv_free_tokens == idle.kv_free_tokens)
    assert freed, f"decode still holds the cancelled request: {decode_stats(vl_stack)}"


def post(stack, body: bytes, path: str = "/v1/chat/completions"):
    req = urllib.request.Request(stack.endpoints.http + path, data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(stack, content, **extra) -> bytes:
    served = json.loads(urllib.request.urlopen(stack.endpoints.http + "/v1/models", timeout=10).read())["data"][0]
    return json.dumps({"model": served["id"], "messages": [{"role": "user", "content": content}],
                       "max_tokens": 4, **extra}).encode()


BAD = {
    "malformed json": (lambda s: b'{"model": ', "not valid JSON"),
    "unknown model": (lambda s: json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).encode(),
                      "not served here"),
    "bad base64": (lambda s: chat(s, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]),
                   "base64"),
    "corrupt image": (lambda s: chat(s, [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}}]), "image"),
    "unsupported media": (lambda s: chat(s, [{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(wav_bytes(0.2, 300)).decode(), "format": "wav"}}]), "audio"),
    "unknown part": (lambda s: chat(s, [{"type": "hologram", "hologram": {}}]), "hologram"),
    "prompt over context": (lambda s: chat(s, "hello " * 6000), "context length"),
    "max_tokens 0": (lambda s: chat(s, "hi", max_tokens=0), "max_tokens"),
    "max_tokens negative": (lambda s: chat(s, "hi", max_tokens=-3), "max_tokens"),
    "oversize body": (lambda s: chat(s, [{"type": "image_url", "image_url": {
        "url": data_uri(b"x" * (70 << 20))}}]), "bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_http_input_gets_400_and_stack_keeps_serving(vl_stack, case):
    make, needle = BAD[case]
    status, body = post(vl_stack, make(vl_stack))
    assert status == 400, body
    assert needle.lower() in body["error"]["message"].lower(), body
    ok_status, ok = post(vl_stack, chat(vl_stack, [{"type": "image_url", "image_url": {"url": data_uri(png_bytes(32, 32, 1))}},
                                                   {"type": "text", "text": "hi"}]))
    assert ok_status == 200 and ok["usage"]["completion_tokens"] >= 1


def test_bad_grpc_input_gets_invalid_argument(vl_stack):
    from easerve.errors import InvalidRequest

    client = Client(vl_stack.endpoints.grpc, timeout=60)
    with pytest.raises(InvalidRequest, match="image"):
        client.generate("hi", images=[b"definitely not an image"], max_tokens=4)
    with pytest.raises(InvalidRequest, match="placeholder|image"):
        client.generate(raw_prompt="no placeholders here", images=[png_bytes(32, 32, 2)], max_tokens=4)
    with pytest.raises(InvalidRequest, match="not served"):
        client.generate("hi", model="other-model", max_tokens=4)
    assert client.generate("hi", max_tokens=2).usage.completion_tokens >= 1


def test_http_client_disconnect_frees_decode_work_and_kv(vl_stack):
    import http.client
    from urllib.parse import urlparse

    idle = decode_stats(vl_stack)
    u = urlparse(vl_stack.endpoints.http)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=chat(vl_stack, "Count forever", max_tokens=3000, stream=True),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(6):
        resp.readline()  # a few SSE lines: tokens are flowing
    assert wait_for(lambda: decode_stats(vl_stack).running == 1)
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    freed = wait_for(lambda: (s := decode_stats(vl_stack)).running == 0 and s.kv_free_tokens == idle.kv_free_tokens)
    assert freed, f"decode still holds the abandoned request: {decode_stats(vl_stack)}"
