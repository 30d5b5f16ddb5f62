"""SLO-aware admission live: two encode instances, a burst of image requests at a gateway with
`--admission reject` and a tight tier (TTFT 6 s). The profile handed to the gateway states a slow
encoder (3 s per item, no batching gain), so an instance with one request queued is predicted
past the tier: some requests are refused at once with RESOURCE_EXHAUSTED and a `retry-after-ms`
equal to the gateway's own prediction (its /trace), every admitted one finishes (nothing
accepted is lost) and meets the tier, and a request sent after the burst is admitted again."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import time
import urllib.request

import grpc
import pytest

from easerve import Client
from easerve.errors import InvalidRequest
from easerve.models.tiny import cached_tiny
from easerve.rpc.errors import RETRY_AFTER_KEY
from easerve.stages.common.peers import POLL_S
from easerve.wire.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from easerve import profile_format as pf
from hasctl.deployment import Deployment, Worker
from hasctl.launch import Stack
from tests.support.media import png_bytes
from tests.support.profiles import make_profile

pytestmark = pytest.mark.slow
ONE = {"threads": 1}
BURST, N = 24, 4


def _profile(path) -> str:
    unloaded = (pf.Unloaded("image", "224x224", 64, N, 3.0, 0.25), pf.Unloaded("text", "", 32, N, 3.0, 0.25))
    prof = dataclasses.replace(make_profile(encode_s_per_item=3.0, prefill_tok_s=1e5, decode_tok_s=1e5),
                               unloaded=unloaded, tiers=pf.tiers_from(unloaded))  # tight: TTFT 6 s, TPOT 0.5 s
    return str(pf.dump(prof, path))


@pytest.fixture(scope="module")
def admit_stack(tiny_root, tmp_path_factory):
    cores = sorted(os.sched_getaffinity(0))
    d = Deployment(model=str(cached_tiny("qwen2.5-vl", tiny_root)), name="admission",
                   encode=tuple(Worker(f"cpu:{cores[i % len(cores)]}", flags={"max-batch": 4, **ONE}) for i in range(2)),
                   prefill=(Worker(flags=ONE),), decode=(Worker(flags={"num-slots": 32, **ONE}),))
    # the profile is slow on purpose (3 s per item, where the tiny encoder takes milliseconds): the
    # online calibration would learn that away within the burst, so this stack runs without it
    d = d.with_flags("gateway", admission="reject", slo_tier="tight", admission_encode_batch=4,
                     no_admission_calibration=True, preprocess_threads=8,  # the burst reaches admission at once
                     profile=_profile(tmp_path_factory.mktemp("admission") / "prof.json")).with_gateway_ports(0, 0)
    stack = Stack(d, env={"EASERVE_LOG_LEVEL": "WARNING"})
    stack.start(timeout=420)
    with grpc.insecure_channel(stack.endpoints.grpc) as ch:  # warm: a cold first request (imports, first
        stub = gateway_pb2_grpc.GatewayStub(ch)              # kernels) would spread the burst's arrivals
        assert [_send(stub, k)[0] for k in (900, 901)] == ["ok", "ok"]  # one at a time: both admitted
    time.sleep(4 * POLL_S)
    yield stack
    stack.stop()


def _request(k: int) -> gateway_pb2.GenerateRequest:
    part = gateway_pb2.ContentPart(image=gateway_pb2.ImageInput(data=png_bytes(48, 48 + 4 * (k % 5), k)))
    return gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role="user", content=[part, gateway_pb2.ContentPart(text="What is it?")])],
        sampling=common_pb2.SamplingParams(max_tokens=N, ignore_eos=True), request_id=f"burst-{k}")


def _send(stub, k: int):
    """("ok", tokens) or ("refused", retry-after ms) or ("error", code)."""
    try:
        tokens = sum(len(m.token_ids) for m in stub.Generate(_request(k), timeout=120))
        return "ok", tokens
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            meta = dict(e.trailing_metadata() or ())
            return "refused", int(meta[RETRY_AFTER_KEY]) if RETRY_AFTER_KEY in meta else None
        return "error", e.code().name


def _trace(stack) -> dict:
    url = f"{stack.endpoints.openai_base_url.removesuffix('/v1')}/trace?last=1000"
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


def test_a_burst_past_the_tier_is_partly_refused_and_what_is_admitted_meets_it(admit_stack):
    with grpc.insecure_channel(admit_stack.endpoints.grpc) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
            results = dict(zip(range(BURST), pool.map(lambda k: _send(stub, k), range(BURST))))
        ok = {k: v for k, (kind, v) in results.items() if kind == "ok"}
        refused = {k: v for k, (kind, v) in results.items() if kind == "refused"}
        assert not [r for r in results.values() if r[0] == "error"], results
        assert refused and ok, results
        assert all(tokens == N for tokens in ok.values())          # nothing accepted is lost
        recs = {r["request_id"]: r for r in _trace(admit_stack)["requests"]}
        for k, retry_ms in refused.items():                         # Retry-After from the prediction
            rec = recs[f"burst-{k}"]
            assert rec["decision"] == "reject" and rec["ttft_ms"] is None
            assert rec["predicted_ttft_ms"] > rec["ttft_limit_ms"]
            assert retry_ms == max(0, round(rec["retry_after_s"] * 1000)) and retry_ms > 0
        probes = [k for k in ok if recs[f"burst-{k}"]["probe"]]    # a predicted miss let in after 1 s of refusals
        assert len(probes) <= 1, probes
        for k in set(ok) - set(probes):                             # the admitted on merit meet the tight tier
            rec = recs[f"burst-{k}"]
            assert rec["decision"] == "admit" and rec["predicted_ttft_ms"] <= rec["ttft_limit_ms"]
            assert rec["ttft_ms"] <= rec["ttft_limit_ms"], rec
        time.sleep(4 * POLL_S)  # the gateway's view of the queues is its last load poll: let one see them empty
        after = _send(stub, BURST)                                  # queues drained: admitted again
        assert after == ("ok", N), after


def test_each_instance_reports_its_recent_pace_for_the_predictor(admit_stack):
    """Stage/Load carries each instance's recent batch seconds and size (easerve/stages/common/pace.py):
    after a few requests every encode instance that ran a batch, prefill and decode report theirs."""
    from easerve.wire.v1 import stage_pb2, stage_pb2_grpc
    with grpc.insecure_channel(admit_stack.endpoints.grpc) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        time.sleep(4 * POLL_S)  # one at a time on drained queues; once the slow-on-purpose profile's
        # prefill and decode are scaled by the real (slower) pace, a request can be refused: fine here
        sent = [_send(stub, 100 + k)[0] for k in range(4)]
        assert "ok" in sent and "error" not in sent, sent
    paces = {}
    for stage, addrs in admit_stack._addrs().items():
        for addr in addrs if stage != "gateway" else ():
            with grpc.insecure_channel(addr) as ch:
                ld = stage_pb2_grpc.StageStub(ch).Load(stage_pb2.LoadRequest(), timeout=10)
                paces[addr] = (stage, ld.recent_batch_s, ld.recent_batch_size)
    enc = [p for p in paces.values() if p[0] == "encode"]
    assert len(enc) == 2 and any(s > 0 and n >= 1 for _, s, n in enc), paces
    assert all(s > 0 and n >= 1 for st, s, n in paces.values() if st in ("prefill", "decode")), paces


def test_the_sdk_sends_the_tier_and_priority_as_metadata(admit_stack):
    client = Client(admit_stack.endpoints.grpc, timeout=120)
    out = client.generate("Hi", max_tokens=N, ignore_eos=True, slo_tier="loose", priority="batch",
                          request_id="sdk-loose")
    assert len(out.token_ids) == N
    rec = next(r for r in _trace(admit_stack)["requests"] if r["request_id"] == "sdk-loose")
    assert (rec["tier"], rec["priority"], rec["modality"], rec["decision"]) == ("loose", "batch", "text", "admit")
    with pytest.raises(InvalidRequest, match="x-easerve-slo-tier"):
        client.generate("Hi", max_tokens=N, slo_tier="instant")
