"""SLO-aware admission at the gateway's HTTP front (a real GatewayCore, no stage listening): a
request predicted to miss its tier is refused with 429 and a Retry-After from the prediction,
before any stage is called (with --admission best-effort: admitted, marked best-effort); the tier comes from the body, else the header, else --slo-tier;
/trace shows each prediction and decision."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from easerve import profile_format as pf
from tests.support.profiles import make_profile
from tests.support.http_api import CHAT, http_client, post

# prefill of 1 token/s: CHAT's 13 prompt tokens are predicted 13 s; tiers from text's unloaded TTFT
# 2 s: tight 4 s, moderate 8 s, loose 16 s (TPOT limits far above the prediction)
UNLOADED = (pf.Unloaded("image", "224x224", 50, 8, 2.0, 1.0), pf.Unloaded("text", "", 30, 8, 2.0, 1.0))


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    prof = dataclasses.replace(make_profile(prefill_tok_s=1.0, decode_tok_s=1e5), unloaded=UNLOADED,
                               tiers=pf.tiers_from(UNLOADED))
    return str(pf.dump(prof, tmp_path_factory.mktemp("prof") / "prof.json"))


@pytest.fixture(scope="module")
def client(loop, adapter, profile_path):  # noqa: F811
    from easerve.stages.gateway.core import GatewayCore
    yield from http_client(loop, adapter, GatewayCore, admission="reject", profile=profile_path, slo_tier="tight")


@pytest.fixture(scope="module")
def best_effort(loop, adapter, profile_path):  # noqa: F811
    from easerve.stages.gateway.core import GatewayCore
    yield from http_client(loop, adapter, GatewayCore, admission="best-effort", profile=profile_path,
                            slo_tier="tight")


def send(loop, client, body, headers=None):
    async def go():
        h = {"Content-Type": "application/json", **(headers or {})}
        async with client.post("/v1/chat/completions", data=json.dumps(body).encode(), headers=h) as r:
            return r.status, r.headers.get("Retry-After"), await r.json(content_type=None)
    return loop.run_until_complete(go())


def trace(loop, client) -> list[dict]:
    async def go():
        async with client.get("/trace?last=10") as r:
            assert r.status == 200
            return (await r.json())["requests"]
    return loop.run_until_complete(go())


def test_a_predicted_miss_is_a_429_with_retry_after_from_the_prediction(loop, client):
    status, retry, answer = send(loop, client, CHAT)
    assert status == 429, answer
    assert "predicted to miss its SLO tier 'tight'" in answer["error"]["message"]
    rec = trace(loop, client)[-1]
    assert rec["decision"] == "reject" and rec["tier"] == "tight" and rec["priority"] == "interactive"
    assert rec["predicted_ttft_ms"] > rec["ttft_limit_ms"] == pytest.approx(4_000)
    assert int(retry) == max(1, math.ceil(rec["retry_after_s"]))
    assert rec["retry_after_s"] == pytest.approx((rec["predicted_ttft_ms"] - 4_000) / 1000, abs=0.5)
    # the record holds the prediction's parts: nothing queued anywhere, the time already spent as it is
    assert rec["seen_queued"] == [0, 0, 0] and rec["raw_queue_ms"] == 0 and rec["raw_service_ms"] > 12_000
    assert rec["predicted_ttft_ms"] == pytest.approx(rec["elapsed_ms"] + rec["ttft_factor"] * rec["raw_service_ms"])


def test_the_tier_comes_from_the_body_then_the_header(loop, client):
    # the loose tier (16 s) fits the prediction: admitted, then the dead prefill answers 503
    status, _, answer = send(loop, client, {**CHAT, "slo_tier": "loose", "priority": "batch"},
                             headers={"x-easerve-slo-tier": "tight"})
    assert status == 503, answer
    rec = trace(loop, client)[-1]
    assert (rec["decision"], rec["tier"], rec["priority"]) == ("admit", "loose", "batch")
    status, _, _ = send(loop, client, CHAT, headers={"x-easerve-slo-tier": "loose"})
    assert status == 503 and trace(loop, client)[-1]["tier"] == "loose"


def test_a_bad_tier_header_is_a_400_naming_it(loop, client):
    status, _, answer = send(loop, client, CHAT, headers={"x-easerve-slo-tier": "instant"})
    assert status == 400 and "x-easerve-slo-tier" in answer["error"]["message"]
    status, _, answer = send(loop, client, CHAT, headers={"x-easerve-priority": "vip"})
    assert status == 400 and "x-easerve-priority" in answer["error"]["message"]


def test_best_effort_admits_the_predicted_miss_and_marks_it(loop, best_effort):
    status, retry, answer = send(loop, best_effort, CHAT)
    assert status == 503 and retry == "1", answer  # admitted: the dead prefill answers, not admission
    rec = trace(loop, best_effort)[-1]
    assert rec["decision"] == "best_effort" and rec["predicted_ttft_ms"] > rec["ttft_limit_ms"]
