"""Every request the simulator is sent ends exactly once, completed or failed, whatever the
arrivals and the deployment; the same inputs give the same result."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from easerve.policy.service_model import HOST_STAGES, ModelConfig
from easerve.sim import SimRequest, simulate
from tests.support.profiles import make_profile
from tests.support.sim_topology import poisson, topo

MODS = ("image", "video", "text")


@st.composite
def cases(draw):
    gaps = draw(st.lists(st.floats(0.0, 0.3), min_size=1, max_size=60))
    t, reqs = 0.0, []
    for i, g in enumerate(gaps):
        t += g
        m = draw(st.sampled_from(MODS))
        reqs.append(SimRequest(i, t, m, {"image": "224x224", "video": "8x112x112"}.get(m, ""),
                               draw(st.integers(1, 64)), draw(st.integers(1, 12))))
    mono = draw(st.integers(0, 1))
    shape = dict(n_enc=draw(st.integers(0 if mono else 1, 2)), n_pre=draw(st.integers(0 if mono else 1, 2)),
                 n_dec=draw(st.integers(0 if mono else 1, 2)), n_mono=mono,
                 device=draw(st.sampled_from(["cuda:{i}", "cpu"])))
    coloc = draw(st.booleans()) or shape["n_pre"] == 0
    enc = {"max_batch": draw(st.sampled_from([1, 2, 8])), "colocate_prefill": coloc,
           "remote_fraction": draw(st.sampled_from([0.0, 0.5, 1.0])) if coloc and shape["n_pre"] else 1.0 if not coloc else 0.0,
           "max_inflight": draw(st.integers(1, 8))}
    if enc["max_batch"] == 1 and draw(st.booleans()):
        enc["batch_mode"] = "request_at_a_time"
    dec = {"max_running": draw(st.integers(1, 4)), "max_waiting": draw(st.integers(0, 3)),
           "kv_capacity_tokens": draw(st.sampled_from([0, 256, 4096]))}
    gw = {"max_inflight": draw(st.integers(1, 40)), "request_timeout_s": draw(st.sampled_from([0.5, 5.0, 600.0]))}
    pre = {"max_inflight": draw(st.integers(1, 8)), "max_batched_tokens": draw(st.sampled_from([64, 2048]))}
    host = tuple((stage, draw(st.sampled_from([0.0, 0.002, 0.05]))) for stage in HOST_STAGES)
    return reqs, topo(enc=enc, dec=dec, gw=gw, pre=pre, **shape), ModelConfig(host_s=host)


@settings(max_examples=60, deadline=None)
@given(cases())
def test_sent_equals_completed_plus_failed(case):
    reqs, t, config = case
    res = simulate(t, make_profile(encode_s_per_item=0.05, decode_tok_s=200), reqs, config)
    assert sorted(r["index"] for r in res.records) == [r.index for r in reqs]  # none lost, none twice
    done = [r for r in res.records if r["error"] is None]
    failed = [r for r in res.records if r["error"] is not None]
    assert len(done) + len(failed) == len(reqs)
    for r, spec in ((r, reqs[r["index"]]) for r in done):
        assert len(r["chunk_s"]) == spec.max_tokens and r["end_s"] == r["chunk_s"][-1]
        assert r["chunk_s"] == sorted(r["chunk_s"]) and r["chunk_s"][0] >= spec.arrival_s
    assert all(r["error_kind"] in ("http_429", "http_400", "http_503", "timeout") for r in failed)


def test_overload_rejects_and_still_accounts():
    reqs = poisson(200, rate=200.0)
    res = simulate(topo(dec={"max_running": 1, "max_waiting": 2}), make_profile(decode_tok_s=100), reqs)
    kinds = [r["error_kind"] for r in res.records]
    assert kinds.count("http_429") > 0 and kinds.count(None) > 0 and len(kinds) == 200


def test_same_inputs_same_result():
    reqs, t, p = poisson(300, rate=20.0, seed=7), topo(n_enc=2, n_pre=2, n_dec=2), make_profile()
    a, b = simulate(t, p, reqs), simulate(t, p, reqs)
    assert a.records == b.records and a.traces == b.traces
    c = simulate(t, p, poisson(300, rate=20.0, seed=8))
    assert c.records != a.records
