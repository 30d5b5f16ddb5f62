"""bench/fidelity_replay.py: service-time error per stage against the profile (neighbours
counted), and the queueing replay with measured call times (MeasuredModel)."""
from __future__ import annotations

import math

import pytest

from bench.fidelity_replay import (
    MeasuredModel,
    Placement,
    Span,
    collect_spans,
    replay_requests,
    replay_ttft_error,
    service_time_errors,
    spans_of,
)
from easerve.policy.service_model import ServiceModel
from easerve.sim import simulate
from tests.support.profiles import make_profile
from tests.support.sim_topology import poisson, topo

IMG = ("image", "224x224")
GPUS = {"encode-0": Placement("cuda:0"), "prefill-0": Placement("cuda:1"), "decode-0": Placement("cuda:2")}


def live_spans(model: ServiceModel, scale: float = 1.0) -> dict[str, list[Span]]:
    """One call of each stage, `scale` x the profile's time, none overlapping another."""
    e = model.encode_s(2, 1.0, *IMG) * scale
    p = model.prefill_s(160, 2) * scale
    d = model.decode_step_s(4, 100) * scale
    return {"encode-0": [Span("encode-0", "encode", 0.0, e, batch=2)],
            "prefill-0": [Span("prefill-0", "prefill", 10.0, 10.0 + p, batch=2, tokens=160)],
            "decode-0": [Span("decode-0", "decode", 20.0, 20.0 + d, batch=4, context=100)]}


def test_measured_as_predicted_is_no_error_and_twice_is_log_2():
    model = ServiceModel(make_profile())
    same = service_time_errors(live_spans(model), model, GPUS, IMG)
    for stage in ("encode", "prefill", "decode"):
        assert same[stage].count == 1 and same[stage].median == pytest.approx(0.0, abs=1e-12), stage
    slow = service_time_errors(live_spans(model, 2.0), model, GPUS, IMG)
    for stage in ("encode", "prefill", "decode"):
        assert slow[stage].median == pytest.approx(math.log(2)) and slow[stage].ratio == pytest.approx(2.0)
    assert same["gateway"].count == 0 and same["gateway"].median is None


def test_overlapping_neighbours_on_shared_cores_count_their_slowdown():
    """Two processes on the same cores (no sharing curve in the profile: 2x while both busy):
    a prefill overlapped by an encode for its whole span is predicted 2x, for half of it 1.5x."""
    model = ServiceModel(make_profile())
    p = model.prefill_s(64, 1)
    cpu = {"encode-0": Placement("cpu"), "prefill-0": Placement("cpu")}
    for covered, factor in ((1.0, 2.0), (0.5, 1.5)):
        d = p * factor
        spans = {"encode-0": [Span("encode-0", "encode", 0.0, d * covered, batch=1)],
                 "prefill-0": [Span("prefill-0", "prefill", 0.0, d, batch=1, tokens=64)]}
        err = service_time_errors(spans, model, cpu, IMG)
        assert err["prefill"].median == pytest.approx(0.0, abs=1e-9), covered
    apart = {"encode-0": Placement("cpu:0"), "prefill-0": Placement("cpu:1")}
    err = service_time_errors(spans, model, apart, IMG)  # on other cores nothing slows it
    assert err["prefill"].median == pytest.approx(math.log(1.5))  # predicted p, measured 1.5 p


def test_a_worker_on_cores_another_process_uses_is_predicted_at_its_environments_cost():
    """A prefill on the cores of another process's worker runs with the shared-cores environment:
    predicted at the profile's shared_env factor even while nothing overlaps it (as the
    simulator's Compute.wire_env has it); on cores of its own at the profile's time; the
    replay's MeasuredModel, whose times already hold it, does not apply it again."""
    import dataclasses

    from easerve.profile_format import SharedEnvPoint
    prof = dataclasses.replace(make_profile(), shared_env=(SharedEnvPoint("prefill", 1.5),))
    model = ServiceModel(prof)
    p = model.prefill_s(64, 1)
    spans = {"encode-0": [Span("encode-0", "encode", 0.0, 0.01, batch=1)],
             "prefill-0": [Span("prefill-0", "prefill", 1.0, 1.0 + 1.5 * p, batch=1, tokens=64)]}
    shared = {"encode-0": Placement("cpu"), "prefill-0": Placement("cpu")}
    assert service_time_errors(spans, model, shared, IMG)["prefill"].median == pytest.approx(0.0, abs=1e-9)
    apart = {"encode-0": Placement("cpu:0"), "prefill-0": Placement("cpu:1")}
    assert service_time_errors(spans, model, apart, IMG)["prefill"].median == pytest.approx(math.log(1.5))
    assert MeasuredModel(prof, spans, where=shared, media=IMG).shared_env("prefill") == 1.0


def test_the_live_gateways_phases_per_request_between_two_scrapes():
    """phase_totals reads the gateway's own metrics (stage latencies by stage and TTFT);
    phase_means_ms is the mean per request of what was counted between two scrapes."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from bench.fidelity_replay import phase_means_ms, phase_totals
    from easerve.stages.gateway.metrics import GatewayMetrics
    m = GatewayMetrics()
    m.stage_latency.observe(1.0, stage="encode")   # before the cell
    m.ttft.observe(2.0)
    before = phase_totals(text_string_to_metric_families(generate_latest(m.registry).decode()))
    for enc, pre, ttft in ((0.05, 0.010, 0.3), (0.07, 0.030, 0.5)):
        m.stage_latency.observe(enc, stage="encode")
        m.stage_latency.observe(pre, stage="preprocess")
        m.ttft.observe(ttft)
    after = phase_totals(text_string_to_metric_families(generate_latest(m.registry).decode()))
    assert after["encode"] == (pytest.approx(1.12), 3.0) and after["ttft"] == (pytest.approx(2.8), 3.0)
    assert phase_means_ms(before, after) == {"encode": pytest.approx(60.0), "preprocess": pytest.approx(20.0),
                                             "ttft": pytest.approx(400.0)}
    assert phase_means_ms(after, after) == {}


def test_trace_shapes_and_urls():
    enc = {"now": 5.0, "buckets": [],
           "spans": [{"kind": "encode", "start": 1.0, "end": 1.5, "share": 0.5, "batch": 3},
                     {"kind": "prefill", "start": 2.0, "end": 2.2, "share": 1.0, "batch": 1}],
           "calls": [{"kind": "prefill", "start": 2.0, "end": 2.2, "batch": 2, "tokens": 90}]}
    got = spans_of("encode-0", enc)
    assert [(s.kind, s.batch, s.tokens, s.share) for s in got] == [("encode", 3, 0, 0.5), ("prefill", 2, 90, 1.0)]
    docs = {"http://e/trace?window_s=600.0&last=20000": enc,
            "http://d/trace?window_s=600.0&last=20000": {"now": 3.0, "spans": [{"kind": "decode", "start": 0.5, "end": 0.6,
                                                                       "batch": 4, "context": 70}]},
            "http://g/trace?last=500": {"requests": [{"request_id": "a", "host_cpu_ms": {
                "parse": 1.0, "media": 2.0, "tokenize": 1.0, "detokenize": 9.0}}]}}

    def fetch(url):
        if url not in docs:
            raise OSError(url)
        return docs[url]
    urls = {"encode-0": "http://e", "decode-0": "http://d", "gateway": "http://g", "prefill-0": "http://p"}
    out = collect_spans(urls, fetch=fetch)
    assert out["prefill-0"] == [] and out["decode-0"][0].context == 70
    assert out["gateway"][0].duration == pytest.approx(0.004)
    assert [s.kind for s in collect_spans({"encode-0": "http://e"}, since=1.8, fetch=fetch)["encode-0"]] == ["prefill"]


def test_measured_model_reproduces_the_measured_calls_of_one_request():
    prof = make_profile()
    model = ServiceModel(prof)
    spans = live_spans(model, 1.0)
    e_meas, p_meas = 0.37, 0.052  # what the live calls took (batch 1 each)
    spans["encode-0"] = [Span("encode-0", "encode", 0.0, e_meas, batch=1)]
    spans["prefill-0"] = [Span("prefill-0", "prefill", 1.0, 1.0 + p_meas, batch=1, tokens=16 + 64)]
    mm = MeasuredModel(prof, spans, where=GPUS, media=IMG)
    assert mm.slowdown("prefill", "encode", True) == 1.0 and mm.sharing("prefill", ("encode",)) == 1.0
    req = poisson(1, 1.0, max_tokens=1)
    run = simulate(topo(), prof, req, service_model=mm)
    (enc,) = run.traces["encode-0"]["spans"]
    assert enc["end"] - enc["start"] == pytest.approx(e_meas)
    wait = enc["start"]  # the encode batcher's wait for more items (no call): the same in both runs
    rec = run.records[0]
    assert rec["chunk_s"][0] - rec["sent_s"] == pytest.approx(wait + e_meas + p_meas)  # the profile has no transfers
    base = simulate(topo(), prof, req)
    assert base.traces["encode-0"]["spans"][0]["start"] == pytest.approx(wait)
    assert base.records[0]["chunk_s"][0] == pytest.approx(wait + model.encode_s(1, 1.0, *IMG) + model.prefill_s(80, 1))


def test_a_replayed_call_keeps_its_buckets_measured_busy_time():
    """Three live prefills of one batch size, 1x, 1x and 4x the profile's time: a replayed call of
    that size takes 2x (their mean, so the stage stays as busy as it was), not 1x (the median)."""
    prof = make_profile()
    model = ServiceModel(prof)
    p = model.prefill_s(64, 1)
    spans = {"prefill-0": [Span("prefill-0", "prefill", 10.0 * i, 10.0 * i + p * f, batch=1, tokens=64)
                           for i, f in enumerate((1.0, 1.0, 4.0))]}
    mm = MeasuredModel(prof, spans, where=GPUS, media=IMG)
    assert mm.prefill_s(64, 1) == pytest.approx(2.0 * p)


def test_hasctl_simulates_a_replay_with_the_measured_call_times_it_is_given():
    """hasctl.simulate.run_simulation (what bench/sim_fidelity's replay calls) runs the
    simulator on the service model it is given: the records of simulate(service_model=mm),
    not the profile's (it once passed the model where exact placement was expected)."""
    from hasctl.bench import BenchConfig
    from hasctl.deployment import preset
    from hasctl.simulate import run_simulation, topology
    from hasctl.workload import WorkloadSpec
    truth, prof = make_profile(encode_s_per_item=0.3), make_profile(encode_s_per_item=0.1)
    d = preset("dynamo-like")
    reqs = poisson(20, 2.0, seed=5)
    live = simulate(topology(d), truth, reqs)
    mm = MeasuredModel(prof, {n: spans_of(n, t) for n, t in live.traces.items()}, media=IMG)
    cfg = BenchConfig(url="http://simulated.invalid", rate=2.0, num_requests=20, seed=5,
                      workload=WorkloadSpec(image_size=(224, 224), output_tokens=8), progress=False)
    got = run_simulation(d, prof, cfg, requests=reqs, service_model=mm)[1].records
    assert got == simulate(topology(d), prof, reqs, service_model=mm).records
    assert got != simulate(topology(d), prof, reqs).records


def test_replay_with_measured_calls_matches_live_and_the_profile_does_not():
    """'Live': a stack whose encode is 3x the profile's; its encode spans are its trace's. The
    replay with the measured call times gets its TTFTs; the profile's times do not."""
    truth, prof = make_profile(encode_s_per_item=0.3), make_profile(encode_s_per_item=0.1)
    reqs = poisson(40, 2.0, seed=3)
    live = simulate(topo(), truth, reqs)
    spans = {"encode-0": spans_of("encode-0", live.traces["encode-0"])}
    assert spans["encode-0"] and {s.batch for s in spans["encode-0"]} - {1}  # it batched under load
    model = ServiceModel(prof)
    replayed = replay_requests(live.records, model, {"image": "224x224"})
    assert [(r.arrival_s, r.text_tokens, r.max_tokens) for r in replayed] == \
           [(r.arrival_s, r.text_tokens, r.max_tokens) for r in reqs]
    measured = simulate(topo(), prof, replayed, service_model=MeasuredModel(prof, spans, where=GPUS, media=IMG))
    err = replay_ttft_error(live.records, measured.records)
    assert err["n"] == 40 and err["replay_ttft_p50_err"] < 0.02 and err["ttft_err_median"] < 0.02
    naive = replay_ttft_error(live.records, simulate(topo(), prof, replayed).records)
    assert naive["replay_ttft_p50_err"] > 0.5
    assert service_time_errors(spans, model, GPUS, IMG)["encode"].median == pytest.approx(math.log(3))


def test_replay_ttft_error_joins_on_index_and_skips_failures():
    live = [{"index": 0, "sent_s": 0.0, "chunk_s": [1.0]}, {"index": 1, "sent_s": 1.0, "chunk_s": [3.0]},
            {"index": 2, "sent_s": 0.0, "chunk_s": [], "error": "429"}]
    sim = [{"index": 1, "sent_s": 1.0, "chunk_s": [5.0]}, {"index": 0, "sent_s": 0.0, "chunk_s": [2.0]},
           {"index": 2, "sent_s": 0.0, "chunk_s": [1.0]}]
    err = replay_ttft_error(live, sim)
    assert err["n"] == 2 and err["ttft_err_median"] == pytest.approx(math.log(2))
    assert err["live_p50_s"] == pytest.approx(1.5) and err["sim_p50_s"] == pytest.approx(3.0)
    assert err["replay_ttft_p50_err"] == pytest.approx(math.log(2))
    assert replay_ttft_error(live, [])["replay_ttft_p50_err"] is None
