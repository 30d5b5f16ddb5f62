"""The simulator drives the live policy classes: its decisions are theirs on the same inputs,
and changing a policy's configuration changes the simulated result."""
from __future__ import annotations

import dataclasses
import math
import random

from easerve.cache.policy import HIT, MISS, EncoderCachePolicy
from easerve.policy.admission import Admission
from easerve.policy.batcher import AdaptiveBatcher
from easerve.policy.clock import ManualClock
from easerve.policy.gateway_state import tier_limits
from easerve.policy.latency import LatencyPredictor
from easerve.policy.placement import POLL_S, LeastLoaded
from easerve.policy.prefill_plan import PrefillBatcher
from easerve.policy.router import DeficitRouter
from easerve.policy.service_model import ServiceModel
from easerve.sim import SimRequest, simulate
from easerve.sim.admission import slo_of
from easerve.sim.run import Sim
from easerve.sim.topology import DEFAULT_EMBED_BYTES_PER_TOKEN, batcher_config
from easerve.stages.common.peers import Peer
from tests.support.profiles import make_profile
from tests.support.sim_topology import poisson, topo


def live_dispatches(cfg, arrivals, durations):
    """The live batcher driven as encode_loop drives it: the arrivals, its deadlines while the
    worker is free, and a worker that runs its n-th batch for durations[n] seconds, then says
    on_free."""
    b, out, i, now, free_at = AdaptiveBatcher(batcher_config(cfg)), [], 0, 0.0, None

    def take(d, t):
        nonlocal free_at
        if d is not None:
            out.append(d)
            free_at = t + durations[len(out) - 1]

    for _ in range(100 * len(arrivals)):
        due = b.next_deadline(now) if free_at is None else None
        t_arrive = arrivals[i][1] if i < len(arrivals) else math.inf
        t_free = math.inf if free_at is None else free_at
        t_due = math.inf if due is None else max(due, now)
        now = min(t_arrive, t_free, t_due)
        if now == math.inf:
            return [(d.item_ids, d.reason) for d in out]
        if now == t_free:
            free_at = None
            b.on_free(now)
            take(b.poll(now), now)
        elif now == t_due:
            take(b.poll(now), now)
        else:
            take(b.add(arrivals[i][0], now), now)
            i += 1
    raise AssertionError("the reference loop did not finish")


def test_batcher_dispatches_are_the_live_batchers():
    reqs = poisson(300, rate=40.0, seed=3)
    t = topo(enc={"max_batch": 4})
    res = simulate(t, make_profile(encode_s_per_item=0.002), reqs)
    got = [(d.item_ids, d.reason) for d in res.dispatches["encode-0"]]
    spans = [s for s in res.traces["encode-0"]["spans"] if s["kind"] == "encode"]
    assert [s["batch"] for s in spans] == [len(ids) for ids, _ in got]
    assert all(abs((s["end"] - s["start"]) - 0.002 * s["batch"]) < 1e-9 for s in spans)  # the profile's cost
    want = live_dispatches(t.encode[0], [(r.index, r.arrival_s) for r in reqs], [s["end"] - s["start"] for s in spans])
    assert got == want
    assert {r for _, r in got} >= {"size", "gap"}
    assert max(len(ids) for ids, _ in got) == 4


def test_router_fractions_are_the_deficit_routers():
    t = topo(enc={"colocate_prefill": True, "remote_fraction": 0.3})
    res = simulate(t, make_profile(encode_s_per_item=0.002), poisson(200, rate=20.0))
    live = DeficitRouter(0.3)
    assert res.routes["encode-0"] == [live.route() for _ in range(200)]
    assert res.routes["encode-0"].count("remote") == 60


def test_decode_admits_fcfs_within_max_running():
    t = topo(dec={"max_running": 2})
    res = simulate(t, make_profile(encode_s_per_item=0.001, decode_tok_s=50), poisson(40, rate=50.0, max_tokens=6))
    admitted = [int(r) for step in res.admissions["decode-0"] for r in step]
    first_token = sorted((rec["chunk_s"][0], rec["index"]) for rec in res.records)
    assert admitted == [i for _, i in first_token]  # KV arrival order: nobody jumps ahead
    ends = sorted(rec["end_s"] for rec in res.records)
    for rec in res.records:  # at most 2 requests decode at any moment: an admission waits for a finish
        starts_while = sum(1 for o in res.records if o["chunk_s"][1] <= rec["chunk_s"][1] < o["end_s"])
        assert starts_while <= 2
    assert len(ends) == 40


def test_swapping_a_policy_changes_the_simulated_result():
    reqs, prof = poisson(300, rate=30.0, seed=1), make_profile(encode_s_per_item=0.01)
    adaptive = simulate(topo(enc={"max_batch": 8}), prof, reqs)
    single = simulate(topo(enc={"max_batch": 1, "batch_mode": "request_at_a_time"}), prof, reqs)
    assert {d.reason for d in single.dispatches["encode-0"]} == {"single"}
    assert max(d.size for d in adaptive.dispatches["encode-0"]) > 1
    ttft = lambda r: sorted(x["chunk_s"][0] - x["sent_s"] for x in r.records)[150]
    assert ttft(adaptive) != ttft(single)
    half = simulate(topo(enc={"colocate_prefill": True, "remote_fraction": 0.5}), prof, reqs)
    most = simulate(topo(enc={"colocate_prefill": True, "remote_fraction": 0.9}), prof, reqs)
    assert half.routes["encode-0"].count("remote") == 150 and most.routes["encode-0"].count("remote") == 270
    assert half.busy_s != most.busy_s


# ---- the live gateway's admission, deadline order, caches and report-based placement -------------
def admission_topo(mode: str, calibrate: bool = False, **kw):
    return topo(gw={"admission": mode, "profile": "the simulated one", "no_admission_calibration": not calibrate},
                **kw)


def tiered(n: int, rate: float, seed: int = 0, **fields) -> list[SimRequest]:
    """Poisson image requests cycling through the tiers and priority classes."""
    tiers, prios = ("tight", "loose", "moderate"), ("interactive", "interactive", "batch")
    return [dataclasses.replace(r, tier=tiers[r.index % 3], priority=prios[r.index % 3 if r.index % 5 else 1],
                                **fields)
            for r in poisson(n, rate=rate, seed=seed)]


def test_admission_decisions_are_the_live_admissions():
    """Each decision the simulated gateway made is what the live `Admission` (built as the live
    gateway builds it) decides on the same state, tier, class and clock; the state is
    `live_state` of the gateway's load reports; rejects answer 429."""
    profile = make_profile(encode_s_per_item=0.05)
    reqs = tiered(120, rate=40.0)
    res = simulate(admission_topo("reject"), profile, reqs)
    clock = ManualClock()
    live = Admission("reject", LatencyPredictor(ServiceModel(profile), clock, None), clock)
    assert [d.index for d in res.decisions] == sorted(d.index for d in res.decisions)
    for d in res.decisions:
        clock.advance_to(d.at)
        spec = reqs[d.index]
        tier = tier_limits(profile, spec.tier, spec.modality)
        assert live.decide(d.shape, d.state, tier, spec.priority, spec.arrival_s) == d.decision
    by_index = {rec["index"]: rec for rec in res.records}
    rejected = [d.index for d in res.decisions if d.decision.action == "reject"]
    assert rejected and len(rejected) < len(reqs)
    assert all(by_index[i]["error_kind"] == "http_429" and "SLO tier" in by_index[i]["error"] for i in rejected)
    assert any(d.state.encode[0].queued > 0 for d in res.decisions)  # it saw the reported queues


def test_admission_best_effort_yields_and_calibrates():
    profile = make_profile(encode_s_per_item=0.05)
    res = simulate(admission_topo("best-effort", calibrate=True), profile, tiered(120, rate=40.0))
    acts = {d.decision.action for d in res.decisions}
    assert "best_effort" in acts and "reject" not in acts
    assert all(rec["error"] is None for rec in res.records)
    assert all(d.decision.yields for d in res.decisions if d.decision.action == "best_effort")
    assert any(d.decision.prediction.ttft_factor != 1.0 for d in res.decisions)  # actual TTFTs came back


def test_without_a_profile_nothing_is_decided_and_no_deadline_is_sent():
    res = simulate(topo(), make_profile(encode_s_per_item=0.05), tiered(60, rate=40.0))
    assert res.decisions == [] and all(rec["error"] is None for rec in res.records)


def live_dispatches_slo(cfg, arrivals, durations):
    """`live_dispatches` with each arrival's (deadline, yields) given to the live batcher."""
    slos = {a[0]: (a[2], a[3]) for a in arrivals}
    real_add = AdaptiveBatcher.add

    def add(self, item_id, now, deadline=None, yields=False):
        return real_add(self, item_id, now, *slos[item_id])
    AdaptiveBatcher.add = add
    try:
        return live_dispatches(cfg, [(a[0], a[1]) for a in arrivals], durations)
    finally:
        AdaptiveBatcher.add = real_add


def test_encode_batches_follow_the_deadline_order_of_the_live_batcher():
    """Deadlines and yields reach the batcher as the live encode service passes them: its
    dispatches are the live batcher's on the same arrivals, and not in arrival order."""
    t = admission_topo("off", enc={"max_batch": 2})
    sim = Sim(t, make_profile(encode_s_per_item=0.02), None)
    res = sim.run(tiered(80, rate=120.0, seed=2))
    arrivals = sim.encoders[0].batching.arrivals
    assert all(d is not None for _, _, d, _ in arrivals) and any(y for *_, y in arrivals)
    spans = [s for s in res.traces["encode-0"]["spans"] if s["kind"] == "encode"]
    got = [(d.item_ids, d.reason) for d in res.dispatches["encode-0"]]
    assert got == live_dispatches_slo(t.encode[0], arrivals, [s["end"] - s["start"] for s in spans])
    order = [i for ids, _ in got for i in ids]
    assert order != sorted(order)  # tight requests overtook: not FCFS


def test_prefill_plans_follow_the_deadline_order(monkeypatch):
    """The prefill planner gets each request's (deadline, yields) as the live prefill stage does
    (the admission decision's, through RequestMeta), and with a slow prefill plans them out of
    arrival order."""
    calls, plans = [], []
    add, plan = PrefillBatcher.add, PrefillBatcher.next_batch

    def recording_add(self, request_id, num_tokens, now, deadline=None, yields=False):
        calls.append((request_id, deadline, yields))
        return add(self, request_id, num_tokens, now, deadline, yields)

    def recording_plan(self, now):
        p = plan(self, now)
        if p is not None:
            plans.extend(p.request_ids)
        return p
    monkeypatch.setattr(PrefillBatcher, "add", recording_add)
    monkeypatch.setattr(PrefillBatcher, "next_batch", recording_plan)
    t = admission_topo("off", pre={"max_prefill_batch": 1})
    res = simulate(t, make_profile(encode_s_per_item=0.001, prefill_tok_s=200.0), tiered(40, rate=200.0, seed=1))
    slo = {d.index: slo_of(d.decision, d.at) for d in res.decisions}
    assert len(calls) == 40 and all((dl, y) == slo[i] for i, dl, y in calls)
    arrived = [i for i, _, _ in calls]
    assert sorted(plans) == sorted(arrived) and plans != arrived  # deadline order, not FCFS


def repeated(n: int, rate: float, keys: int, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    return [dataclasses.replace(r, content=f"media-{rng.randrange(keys)}") for r in poisson(n, rate=rate, seed=seed)]


def test_encoder_cache_is_the_live_policy():
    """A request whose media an instance holds skips encode; hits, misses and evictions are the
    live `EncoderCachePolicy`'s on the same keys and sizes."""
    profile = make_profile(encode_s_per_item=0.01)
    size = ServiceModel(profile).media_tokens("image", "224x224") * DEFAULT_EMBED_BYTES_PER_TOKEN  # no transfer section
    gb = 2.5 * size / 2**30  # room for two embeddings
    sim = Sim(topo(enc={"encoder_cache_gb": gb}), profile)
    reqs = repeated(60, rate=5.0, keys=4)
    res = sim.run(reqs)
    live = EncoderCachePolicy(int(gb * 2**30))
    for index, state in sim.encoders[0].cache.log:
        key = reqs[index].content
        if state == "held":
            live.complete(key, None, size)
            continue
        assert live.lookup(key).state == state
        if state == MISS:
            live.begin(key)
    states = [s for _, s in sim.encoders[0].cache.log]
    assert states.count(HIT) > 0 and states.count(MISS) > 4 and live.stats.evictions > 0
    encoded = sum(len(d.item_ids) for d in res.dispatches["encode-0"])
    assert encoded == states.count(MISS) < len(reqs)
    assert all(rec["error"] is None for rec in res.records)


def test_prefix_cache_charges_only_the_uncached_tokens():
    """A prefill whose media blocks the live `PrefixCache` holds computes only the rest."""
    profile = make_profile(encode_s_per_item=0.001, prefill_tok_s=2000.0)
    sim = Sim(topo(enc={"encoder_cache_gb": 0}), profile)
    reqs = repeated(30, rate=5.0, keys=2)
    sim.run(reqs)
    pre = sim.remote_prefills[0]
    hits = dict(pre.prefix.hits)
    media = sim.model.media_tokens("image", "224x224")
    seen: set[str] = set()
    for r in reqs:
        assert hits[r.index] == (media // 16) * 16 * (r.content in seen)
        seen.add(r.content)
    off = Sim(topo(enc={"encoder_cache_gb": 0}, pre={"no_prefix_cache": True}), profile)
    off.run(reqs)
    assert pre.compute.busy_s < off.remote_prefills[0].compute.busy_s - 1e-6


def test_unique_media_change_nothing():
    """Default workloads (unique media): the caches never hit, results are those without them."""
    profile, reqs = make_profile(encode_s_per_item=0.01), poisson(80, rate=30.0)
    on = simulate(topo(), profile, reqs)
    off = simulate(topo(enc={"encoder_cache_gb": 0}, pre={"no_prefix_cache": True}), profile, reqs)
    assert on.records == off.records


def test_placement_is_the_live_peers_on_load_reports():
    """The gateway places as the live `Peers`: `LeastLoaded` over each instance's `Peer.candidate`
    (reported at the last poll, every POLL_S, plus what it sent since)."""
    sim = Sim(topo(n_enc=2), make_profile(encode_s_per_item=0.03))
    res = sim.run(poisson(200, rate=60.0))
    log = sim.gateway.places["encode"].log
    polls = [e for e in log if e[0] == "poll"]
    assert all(abs(b[1] - a[1] - POLL_S) < 1e-9 for a, b in zip(polls, polls[1:]))
    peers, live, picks = [Peer(str(i), None, None) for i in range(2)], LeastLoaded(), 0
    for entry in log:
        if entry[0] == "poll":
            for p, (reported, capacity) in zip(peers, entry[2]):
                p.reported, p.capacity, p.sent_since_poll = reported, capacity, 0
            continue
        _, _, cands, key = entry
        assert tuple(p.candidate() for p in peers) == cands
        assert live.choose(cands) == key
        peers[int(key)].sent_since_poll += 1
        picks += 1
    assert picks == 200 and all(rec["error"] is None for rec in res.records)


def test_report_placement_differs_from_exact_counts():
    """Between polls the gateway does not see completions: placing by reports is not placing by
    exact counts (still available as exact_placement)."""
    profile, reqs = make_profile(encode_s_per_item=0.03), poisson(200, rate=60.0)

    def placed(exact: bool) -> list[str]:
        sim = Sim(topo(n_enc=2), profile, exact_placement=exact)
        sim.run(reqs)
        return [e[3] for e in sim.gateway.places["encode"].log if e[0] == "pick"]
    assert placed(True) != placed(False)
