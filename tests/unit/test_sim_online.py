"""The online controller inside the simulator: its plans reach the live policies, and the
autoscaler adds instances under a rate step and drains them after, losing nothing."""
from __future__ import annotations

from easerve.policy.online import OnlineBounds, OnlineConfig
from easerve.sim import SimRequest, simulate
from easerve.sim.online import OnlineDriver
from easerve.sim.workload import piecewise_poisson
from tests.support.profiles import make_profile
from tests.support.sim_topology import topo

STEP = [(30.0, 8.0), (60.0, 40.0), (150.0, 8.0)]  # encode carries 20 req/s per instance
CFG = OnlineConfig(bounds=OnlineBounds(min_batch=1, max_batch=16, min_instances=1, max_instances=4),
                   window_s=5.0, interval_s=1.0, dwell_s=5.0, reversal_dwell_s=20.0)


def requests(segments=STEP, seed=0):
    return [SimRequest(i, t, "image", "224x224", 16, 4) for i, t in enumerate(piecewise_poisson(segments, seed))]


def run(online=None, segments=STEP):
    t = topo(n_dec=2, enc={"max_batch": 2, "max_inflight": 4096}, dec={"max_running": 64},
             gw={"max_inflight": 4096}, pre={"max_inflight": 4096})
    return simulate(t, make_profile(encode_s_per_item=0.05, prefill_tok_s=20000.0, decode_tok_s=50000.0),
                    requests(segments), online=online)


def ttfts(res):
    return sorted(r["chunk_s"][0] - r["scheduled_s"] for r in res.records if r["error"] is None)


def test_piecewise_poisson_follows_the_segments():
    times = piecewise_poisson([(100.0, 2.0), (100.0, 10.0)], seed=1)
    first = sum(t < 100 for t in times)
    assert 160 <= first <= 240 and 850 <= len(times) - first <= 1150
    assert times == sorted(times)


def test_autoscaler_adds_encode_under_the_step_and_drains_it_after():
    driver = OnlineDriver(CFG, autoscale=True)
    res = run(driver)
    enc = [c for c in driver.changes if c.knob == "instances_encode"]
    ups = [c for c in enc if c.new > c.old]
    downs = [c for c in enc if c.new < c.old]
    assert ups and 30.0 <= ups[0].at <= 60.0, enc          # during the step
    assert downs and downs[-1].at > 90.0 and downs[-1].new == 1, enc  # back to one after it
    assert all(r["error"] is None for r in res.records)    # nothing lost on a drain
    drained = [a for a in driver.actions if a[2] == "drain" and a[1] == "encode"]
    assert drained
    for t, _, _, name in drained:  # a draining instance takes no new work (what it held finishes)
        later = [a for a in driver.actions if a[3] == name and a[2] == "add" and a[0] > t]
        until = later[0][0] if later else float("inf")
        assert not [d for d in res.dispatches[name] if t + 1.0 < d.at < until]
    assert res.dispatches["encode-1"]                      # the added encode instance ran batches
    static = run(None)
    assert ttfts(res)[int(0.9 * len(ttfts(res)))] < 0.5 * ttfts(static)[int(0.9 * len(ttfts(static)))]


def test_b_reaches_the_live_batcher():
    """Knobs only (no autoscaling): B follows encode's utilization, and the batches the live
    batcher hands out follow B."""
    driver = OnlineDriver(CFG)
    res = run(driver)
    b = [c for c in driver.changes if c.knob == "max_batch"]
    up = [c for c in b if c.new > c.old]
    assert up and all(c.reason == "encode_busy" and 30.0 <= c.at <= 90.0 for c in up), b
    assert max(c.new for c in up) == 16
    sizes = [(d.at, d.size) for d in res.dispatches["encode-0"]]
    assert max(n for t, n in sizes if t <= b[0].at) <= 2                       # the deployment's B
    assert 2 < max(n for t, n in sizes if up[-1].at < t < 90.0) <= up[-1].new  # the controller's


def test_within_a_budget_the_busy_stage_takes_an_instance_from_an_idle_one():
    """Budget 4 (the deployment's own instances): encode, saturated by the step, takes one of the
    two idle decode instances (drained as the encode instance is added); never more than 4 held."""
    driver = OnlineDriver(CFG, budget=4)
    res = run(driver)
    drain = next(a for a in driver.actions if a[2] == "drain")
    add = next(a for a in driver.actions if a[2] == "add")
    assert drain[1] == "decode" and add[1] == "encode" and drain[0] == add[0] and 30.0 <= add[0] <= 90.0
    assert driver.gpu_seconds <= 4 * (res.sim_seconds + CFG.interval_s)
    assert res.dispatches["encode-1"] and all(r["error"] is None for r in res.records)
