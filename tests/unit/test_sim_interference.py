"""Workers that share CPU cores slow each other down in the simulator: workers of other processes
by processor sharing (the profile's sharing curve, else 1 + k), workers of one process by the
measured pair; a monolith's stages take turns; on a GPU an unmeasured pair does not interfere."""
from __future__ import annotations

import dataclasses
import statistics

import pytest

from easerve.sim import simulate
from easerve.policy.service_model import ModelConfig
from easerve.sim.run import Sim
from easerve.profile_format import Interference, SharedEnvPoint, SharingPoint
from tests.support.profiles import make_profile
from tests.support.sim_topology import poisson, topo


def computes(device: str, profile=None):
    sim = Sim(topo(device=device), profile or make_profile())
    return sim.encoders[0].compute, sim.remote_prefills[0].compute, sim.decoders[0].compute


def test_busy_workers_on_shared_cores_share_them():
    enc, pre, dec = computes("cpu")
    assert dec.factor() == 1.0
    enc.busy_kind = "encode"
    assert dec.factor() == 2.0          # two on the same cores: half speed each
    pre.busy_kind = "prefill"
    assert dec.factor() == 3.0          # three: a third each
    assert dec.factor(skip=pre) == 2.0


def test_disjoint_cores_and_unprofiled_gpus_do_not_interfere():
    for device in ("cpu:{i}", "cuda:0"):
        enc, pre, dec = computes(device)
        enc.busy_kind, pre.busy_kind = "encode", "prefill"
        assert dec.factor() == 1.0, device


def test_a_measured_pair_slows_workers_of_one_process_and_the_sharing_curve_those_of_others():
    prof = dataclasses.replace(make_profile(), interference=(Interference("prefill", "encode", 1.25),))
    sim = Sim(topo(device="cpu", enc={"colocate_prefill": True}), prof)
    enc, local, remote = sim.encoders[0].compute, sim.encoders[0].local.compute, sim.remote_prefills[0].compute
    enc.busy_kind = "encode"
    assert local.factor() == 1.25       # same process: the measured pair (hasctl profile: two threads)
    assert remote.factor() == 2.0       # another process: processor sharing (no curve in the profile)
    curve = (SharingPoint("prefill", "encode", 1, 1.3, 2), SharingPoint("prefill", "encode", 2, 1.8, 2),
             SharingPoint("prefill", "decode", 2, 1.4, 2))
    sim = Sim(topo(device="cpu", enc={"colocate_prefill": True}), dataclasses.replace(prof, sharing=curve))
    enc, remote, dec = sim.encoders[0].compute, sim.remote_prefills[0].compute, sim.decoders[0].compute
    enc.busy_kind = "encode"
    assert remote.factor() == 1.3
    dec.busy_kind = "decode"
    assert remote.factor() == pytest.approx((1.8 + 1.4) / 2)   # k = 2: each neighbour's curve at 2


ENV = (SharedEnvPoint("encode", 1.4), SharedEnvPoint("prefill", 1.5), SharedEnvPoint("decode", 1.7))


def test_a_worker_launched_with_the_shared_cores_environment_runs_at_its_measured_cost():
    """A model worker whose CPU cores another process's worker also uses runs with
    SHARED_CORES_ENV: the profile's shared_env factor, with no neighbour busy and under the
    sharing curve's slowdown when one is; a worker alone on its cores, or a monolith (one
    process), runs at the profile's time."""
    prof = dataclasses.replace(make_profile(), shared_env=ENV)
    enc, pre, dec = computes("cpu", prof)
    assert (enc.factor(), pre.factor(), dec.factor()) == (1.4, 1.5, 1.7)
    enc.busy_kind = "encode"
    assert dec.factor() == pytest.approx(1.7 * 2.0)     # times processor sharing (no curve in the profile)
    assert all(c.factor() == 1.0 for c in computes("cpu:{i}", prof))
    mono = Sim(topo(n_enc=0, n_pre=0, n_dec=0, n_mono=1, device="cpu"), prof)
    assert all(c.factor() == 1.0 for c in (mono.monolith[0].compute, mono.monolith[0].local.compute,
                                           mono.mono_decode[0].compute))
    sim = Sim(topo(device="cpu"), prof)
    ends = {}
    sim.decoders[0].compute.start("decode", 0.5, lambda: ends.setdefault("decode", sim.events.now()))
    sim.events.run()
    assert ends == {"decode": pytest.approx(0.85)}


@pytest.mark.parametrize("name", ["default", "dynamo-like", "colocated", "monolith", "split", "monolith+decode"])
def test_the_simulator_gives_the_shared_cores_environment_to_the_workers_the_launcher_does(name):
    """hasctl.deployment.shares_cores (the live launcher's rule) against Compute.shared_cores_env
    on the same deployment's topology (hasctl.simulate.topology), worker by worker."""
    from hasctl.deployment import STAGES, Worker, preset, shares_cores
    from hasctl.simulate import topology
    if name == "split":      # encode and prefill on core 0, decode alone on core 1
        d = dataclasses.replace(preset("default"), encode=(Worker(device="cpu:0"),), prefill=(Worker(device="cpu:0"),),
                                decode=(Worker(device="cpu:1"),))
    elif name == "monolith+decode":   # a monolith alone on core 0, a prefill and a decode on core 1
        d = dataclasses.replace(preset("monolith"), monolith=(Worker(device="cpu:0"),),
                                decode=(Worker(device="cpu:1"),), prefill=(Worker(device="cpu:1"),))
    else:
        d = preset(name)
    sim = Sim(topology(d), dataclasses.replace(make_profile(), shared_env=ENV))
    workers = {("encode", i): [e.compute] + ([e.local.compute] if e.local else []) for i, e in enumerate(sim.encode)}
    workers |= {("prefill", i): [p.compute] for i, p in enumerate(sim.remote_prefills)}
    workers |= {("decode", i): [x.compute] for i, x in enumerate(sim.decode)}
    workers |= {("monolith", i): [m.compute, m.local.compute, sim.mono_decode[i].compute]
                for i, m in enumerate(sim.monolith)}
    assert sorted(workers) == sorted((s, i) for s in STAGES for i in range(len(getattr(d, s))))
    live = {key: shares_cores(d, *key) for key in workers}
    simulated = {key: {c.shared_cores_env() for c in cs} for key, cs in workers.items()}
    assert simulated == {key: {v} for key, v in live.items()}
    assert set(live.values()) == ({False, True} if name in ("split", "monolith+decode") else
                                  {False} if name == "monolith" else {True})


def test_a_job_is_slowed_only_while_a_neighbour_runs_processor_sharing():
    sim = Sim(topo(device="cpu"), make_profile())
    enc, dec = sim.encoders[0].compute, sim.decoders[0].compute
    ends = {}
    dec.start("decode", 1.0, lambda: ends.setdefault("decode", sim.events.now()))
    sim.events.at(0.5, lambda: enc.start("encode", 0.25, lambda: ends.setdefault("encode", sim.events.now())))
    sim.events.run()
    # both at half speed from 0.5: encode's 0.25 s of work ends at 1.0; decode had 0.5 s left at
    # 0.5, did 0.25 of it by 1.0 and the rest alone
    assert ends == {"encode": pytest.approx(1.0), "decode": pytest.approx(1.25)}
    assert dec.busy_s == pytest.approx(1.25) and enc.busy_s == pytest.approx(0.5)


def monolith_starts(mode: str, prof=None) -> list[tuple[str, int, float]]:
    """(kind, others of the monolith busy, factor) at each job start of a monolith run."""
    sim = Sim(topo(n_enc=0, n_pre=0, n_dec=0, n_mono=1, device="cpu"), prof or make_profile(),
              ModelConfig(monolith=mode))
    group = [sim.monolith[0].compute, sim.monolith[0].local.compute, sim.mono_decode[0].compute]
    starts = []
    for c in group:
        def start(kind, work_s, done, factor=None, c=c, orig=c.start):
            starts.append((kind, sum(o.busy_kind is not None for o in group if o is not c), c.factor()))
            return orig(kind, work_s, done, factor)
        c.start = start
    recs = sim.run(poisson(40, 6.0, seed=3, max_tokens=8)).records
    assert all(r["error"] is None for r in recs)
    assert {k for k, _, _ in starts} == {"encode", "prefill", "decode"}
    return starts


def test_a_serial_monoliths_encode_prefill_and_decode_take_turns():
    starts = monolith_starts("serial")
    assert all(busy == 0 and f == 1.0 for _, busy, f in starts)   # never two at once, never slowed by each other


def test_a_threaded_monoliths_stages_overlap_slowed_by_the_in_process_pairs_not_the_sharing_curve():
    stages = ("encode", "prefill", "decode")
    prof = dataclasses.replace(make_profile(), interference=tuple(Interference(a, b, 1.5) for a in stages for b in stages),
                               sharing=tuple(SharingPoint(a, b, 1, 1.1, 2) for a in stages for b in stages))
    starts = monolith_starts("threads", prof)
    assert {busy for _, busy, _ in starts} == {0, 1, 2}
    assert all(f == 1.0 + 0.5 * busy for _, busy, f in starts)
    with pytest.raises(ValueError, match="monolith must be one of"):
        ModelConfig(monolith="fibres")


def test_processes_that_overlap_well_beat_a_monolith():
    """With a measured sharing curve below processor sharing's 1 + k (each process alone leaves
    cores idle), three processes on the same cores overlap their stages; a monolith's threads
    slow each other by the in-process pairs (unmeasured here: 2.0 each)."""
    prof = dataclasses.replace(make_profile(), sharing=tuple(
        SharingPoint(s, b, k, 1.0 + 0.2 * k, 2) for s in ("encode", "prefill", "decode")
        for b in ("encode", "prefill", "decode") for k in (1, 2)))
    reqs = poisson(60, 6.0, seed=2, max_tokens=16)

    def ttft(t) -> float:
        recs = simulate(t, prof, reqs).records
        return statistics.median(r["chunk_s"][0] - r["sent_s"] for r in recs if r["error"] is None)
    split, mono = ttft(topo(device="cpu")), ttft(topo(n_enc=0, n_pre=0, n_dec=0, n_mono=1, device="cpu"))
    assert mono > 1.3 * split


def test_shared_cores_lengthen_decode_steps_in_a_run():
    reqs = poisson(40, 4.0, seed=1, max_tokens=16)

    def tpot(device: str) -> float:
        recs = simulate(topo(device=device), make_profile(), reqs).records
        return statistics.median((r["chunk_s"][-1] - r["chunk_s"][0]) / 15 for r in recs if r["error"] is None)
    assert tpot("cpu") > 1.2 * tpot("cpu:{i}")


def test_a_stacks_request_overhead_delays_every_first_token_by_it_and_takes_no_core_time():
    reqs = poisson(40, 3.0, seed=4)
    base = simulate(topo(), make_profile(), reqs)
    slow = simulate(topo(), make_profile(), reqs, ModelConfig(request_overhead_s=0.25))
    ttft = lambda res: {r["index"]: r["chunk_s"][0] - r["sent_s"] for r in res.records}  # noqa: E731
    lone = simulate(topo(), make_profile(), reqs[:1], ModelConfig(request_overhead_s=0.25))
    assert ttft(lone)[0] == pytest.approx(ttft(simulate(topo(), make_profile(), reqs[:1]))[0] + 0.25)
    assert statistics.median(ttft(slow).values()) > statistics.median(ttft(base).values()) + 0.2
    assert slow.busy_s == pytest.approx(base.busy_s)      # the same work on every worker
    with pytest.raises(ValueError, match="request_overhead_s must be >= 0"):
        ModelConfig(request_overhead_s=-0.1)
