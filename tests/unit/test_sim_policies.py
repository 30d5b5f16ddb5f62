"""The simulator drives the live policy classes: its decisions are theirs on the same inputs,
and changing a policy's configuration changes the simulated result."""
from __future__ import annotations

import math

from easerve.policy.batcher import AdaptiveBatcher
from easerve.policy.router import DeficitRouter
from easerve.sim import simulate
from easerve.sim.topology import batcher_config
from tests.profiles import make_profile
from tests.unit.sim_helpers import poisson, topo


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
