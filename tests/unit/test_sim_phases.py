"""The simulator's per-request phases (easerve/sim/phases.py), in the live gateway's terms:
preprocessing, encode queue, encode batch, prefill batch and TTFT, each a mean over requests."""
from __future__ import annotations

import dataclasses

import pytest

from easerve.policy.service_model import ServiceModel
from easerve.profile_format import GatewayPoint
from easerve.sim import SimRequest, simulate
from tests.support.profiles import make_profile
from tests.support.sim_topology import topo

ONE_AT_A_TIME = {"max_batch": 1, "batch_mode": "request_at_a_time"}


def test_a_lone_requests_phases_are_its_calls_and_add_up_to_its_ttft():
    prof = dataclasses.replace(make_profile(), revision=2, gateway=(GatewayPoint("image", "224x224", 0.004),))
    model = ServiceModel(prof)
    req = SimRequest(0, 0.0, "image", "224x224", 16, 4)
    res = simulate(topo(enc=ONE_AT_A_TIME), prof, [req])
    tokens = 16 + model.media_tokens("image", "224x224")
    want = {"preprocess": 4.0, "queue": 0.0, "encode": model.encode_s(1, 1.0, "image", "224x224") * 1e3,
            "prefill": model.prefill_s(tokens, 1) * 1e3}
    assert res.phases_ms.keys() == {*want, "ttft"}
    for phase, ms in want.items():
        assert res.phases_ms[phase] == pytest.approx(ms, abs=0.01), phase
    assert res.phases_ms["ttft"] == pytest.approx(sum(want.values()), abs=0.05)  # no transfers, no host work


def test_a_request_behind_another_waits_in_the_encode_queue_for_its_batch():
    prof = make_profile()
    enc = ServiceModel(prof).encode_s(1, 1.0, "image", "224x224") * 1e3
    reqs = [SimRequest(i, 0.0, "image", "224x224", 16, 4) for i in range(2)]
    res = simulate(topo(enc=ONE_AT_A_TIME), prof, reqs)
    assert res.phases_ms["queue"] == pytest.approx(enc / 2, abs=0.01)   # 0 for the first, one encode for the second
    assert res.phases_ms["encode"] == pytest.approx(enc, abs=0.01)
    text = simulate(topo(), prof, [SimRequest(0, 0.0, "text", "", 16, 4)])
    assert "encode" not in text.phases_ms and "queue" not in text.phases_ms and "prefill" in text.phases_ms
