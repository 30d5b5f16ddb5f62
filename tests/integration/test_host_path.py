"""The gateway's host path, live: its host CPU by phase (GET /metrics, GET /trace) after a request."""
from __future__ import annotations

import json
import urllib.request

import pytest

from tests.support.media import data_uri, png_bytes

pytestmark = pytest.mark.slow


def _post(base: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _chat(content: list, max_tokens: int = 2) -> dict:
    return {"model": "m", "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [*content, {"type": "text", "text": "What is this?"}]}]}


def _host_seconds(metrics: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith('easerve:host_cpu_seconds_total{') and 'stage="gateway"' in line:
            phase = line.split('phase="')[1].split('"')[0]
            out[phase] = float(line.split()[-1])
    return out


def test_gateway_exports_host_cpu_by_phase_and_per_request(vl_stack):
    base = vl_stack.endpoints.http
    model = json.loads(urllib.request.urlopen(base + "/v1/models", timeout=30).read())["data"][0]["id"]
    body = _chat([{"type": "image_url", "image_url": {"url": data_uri(png_bytes(336, 448, seed=11))}}])
    body["model"] = model
    r = _post(base, body)
    assert r["usage"]["completion_tokens"] > 0
    seen = _host_seconds(urllib.request.urlopen(base + "/metrics", timeout=30).read().decode())
    assert seen["parse"] > 0 and seen["media"] > 0 and seen["tokenize"] > 0, seen
    recs = json.loads(urllib.request.urlopen(base + "/trace?last=50", timeout=30).read())["requests"]
    mine = [x for x in recs if x["request_id"] == r["id"]]
    assert len(mine) == 1, recs
    ms = mine[0]["host_cpu_ms"]
    assert ms["parse"] > 0 and ms["media"] > 0 and ms["tokenize"] > 0 and ms["detokenize"] > 0, ms
