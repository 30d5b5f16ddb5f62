"""The stack's per-request host work in the simulator (ModelConfig.host_s, easerve/sim/host.py):
charged as core time on the process's cores, one job at a time per process."""
from __future__ import annotations

import pytest

from easerve.policy.service_model import ModelConfig, ServiceModel
from easerve.sim import SimRequest, simulate
from easerve.sim.compute import Compute
from easerve.sim.events import EventQueue
from easerve.sim.host import HostWorker
from tests.support.profiles import make_profile
from tests.support.sim_topology import topo


def ttft(res) -> float:
    (r,) = res.records
    return r["chunk_s"][0] - r["scheduled_s"]


def test_alone_host_work_adds_its_seconds_to_ttft():
    """On GPUs (host threads on the node's 16 cores, nothing else busy on them) each stage's
    host work before the first token adds exactly its seconds."""
    req = [SimRequest(0, 0.0, "image", "224x224", 16, 4)]
    p, t = make_profile(), topo()
    base = simulate(t, p, req)
    host = ModelConfig(host_s=(("gateway", 0.010), ("encode", 0.020), ("prefill", 0.040), ("decode", 0.5)))
    res = simulate(t, p, req, host)
    assert ttft(res) - ttft(base) == pytest.approx(0.070, abs=1e-9)  # decode's comes after the first token
    (r,), (b,) = res.records, base.records
    assert r["end_s"] - r["chunk_s"][0] == pytest.approx(b["end_s"] - b["chunk_s"][0] + 0.5, abs=1e-9)


def test_host_and_model_jobs_share_the_cores():
    """2 cores: a model job (a thread per core) of 1 s and a host job (one thread) of 0.5 s
    started together: 3 threads on 2 cores, each at 2/3 speed until the host job ends at
    0.75 s; the model job ends at 1.25 s, the 2.5 core-seconds of work on 2 cores."""
    ev, model = EventQueue(), ServiceModel(make_profile())
    enc, host = Compute(ev, model, "encode", "cpu:0-1", 1, "e"), Compute(ev, model, "host", "cpu:0-1", 1, "h")
    enc.neighbours, host.neighbours = [host], [enc]
    ends = {}
    enc.start("encode", 1.0, lambda: ends.setdefault("encode", ev.now()))
    host.start("host", 0.5, lambda: ends.setdefault("host", ev.now()))
    ev.run()
    assert ends["host"] == pytest.approx(0.75) and ends["encode"] == pytest.approx(1.25)


def test_a_process_runs_its_host_jobs_one_at_a_time():
    ev = EventQueue()
    w = HostWorker(ev, ServiceModel(make_profile()), "cuda:0", "gateway")
    ends: list[float] = []
    for _ in range(3):
        w.run(0.1, lambda: ends.append(ev.now()))
    ev.run()
    assert ends == pytest.approx([0.1, 0.2, 0.3]) and w.jobs == 3


def test_host_work_lowers_capacity_on_shared_cores():
    """Every stage on the same 2 cores: a burst finishes later by about the host core time
    (per request: 30 ms of host work), not by nothing as a pure delay would."""
    reqs = [SimRequest(i, 0.0, "image", "224x224", 16, 4) for i in range(40)]
    p = make_profile(encode_s_per_item=0.01, prefill_tok_s=20000.0, decode_tok_s=20000.0)
    t = topo(device="cpu:0-1", gw={"max_inflight": 100}, enc={"max_inflight": 100})
    span = lambda res: max(r["end_s"] for r in res.records)  # noqa: E731
    base = span(simulate(t, p, reqs))
    host = span(simulate(t, p, reqs, ModelConfig(host_s=(("gateway", 0.01), ("encode", 0.01), ("prefill", 0.01)))))
    assert host - base > 0.5 * 40 * 0.03 / 2  # at least half the added core time on 2 cores


def test_bad_host_entries_say_what_to_change():
    with pytest.raises(ValueError, match="stage one of"):
        ModelConfig(host_s=(("tokenizer", 0.01),))
    with pytest.raises(ValueError, match="seconds >= 0"):
        ModelConfig(host_s=(("gateway", -1.0),))


def with_gateway_point(profile, seconds: float):
    from dataclasses import replace

    from easerve.profile_format import GatewayPoint
    return replace(profile, gateway=(GatewayPoint("image", "224x224", seconds),))


def test_the_gateways_host_work_includes_its_preprocessing_once():
    """The gateway's host work per request (10 ms, measured as its process CPU) holds its
    preprocessing (the profile's gateway point, 4 ms): TTFT rises by 10 ms, not 14."""
    req = [SimRequest(0, 0.0, "image", "224x224", 16, 4)]
    p, t = make_profile(), topo()
    base = ttft(simulate(t, p, req))
    pre = with_gateway_point(p, 0.004)
    assert ttft(simulate(t, pre, req)) - base == pytest.approx(0.004, abs=1e-9)
    assert ttft(simulate(t, pre, req, ModelConfig(host_s=(("gateway", 0.010),)))) - base == pytest.approx(0.010, abs=1e-9)


def test_preprocessing_takes_core_time_on_shared_cores():
    """Every stage and the gateway on the same 2 cores, 40 requests at once, 20 ms of
    preprocessing each on the gateway's 2 threads: the burst ends later by at least half of
    those 0.8 core-seconds over 2 cores (a pure delay overlapped with the model's work, so the
    end moved by little more than one request's preprocessing)."""
    reqs = [SimRequest(i, 0.0, "image", "224x224", 16, 4) for i in range(40)]
    p = make_profile(encode_s_per_item=0.01, prefill_tok_s=20000.0, decode_tok_s=20000.0)
    t = topo(device="cpu:0-1", gw={"max_inflight": 100}, enc={"max_inflight": 100})
    span = lambda res: max(r["end_s"] for r in res.records)  # noqa: E731
    base = span(simulate(t, p, reqs))
    pre = span(simulate(t, with_gateway_point(p, 0.02), reqs))
    assert pre - base > 0.5 * 40 * 0.02 / 2
