"""The online controller (easerve/policy/online.py): what it moves, why, and that it never oscillates."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from easerve.policy.clock import ManualClock
from easerve.policy.online import Knobs, OnlineBounds, OnlineConfig, OnlineController

BOUNDS = OnlineBounds(min_batch=1, max_batch=16, min_remote_fraction=0.2, max_remote_fraction=1.0,
                      min_tolerance=0.0, max_tolerance=0.3, min_instances=1, max_instances=4)
CFG = OnlineConfig(bounds=BOUNDS, window_s=10.0, interval_s=1.0, dwell_s=20.0, reversal_dwell_s=60.0, colocated=True)


class Load:
    """Feeds the controller cumulative busy counters as a stage at a given utilization would."""

    def __init__(self, ctl: OnlineController, clock: ManualClock) -> None:
        self.ctl, self.clock = ctl, clock
        self.busy = {s: 0.0 for s in ("encode", "prefill", "decode", "local_prefill")}
        self.queued = {s: 0 for s in self.busy}

    def run(self, seconds: float, util: dict[str, float], rate: float = 4.0, growth: dict[str, int] | None = None):
        plans = []
        for _ in range(int(seconds)):
            now = self.clock.advance(1.0)
            for _ in range(int(rate)):
                self.ctl.on_arrival(now, "image")
            for s in self.busy:
                n = self.ctl.desired[s] if s in self.ctl.desired else 1
                self.busy[s] += util.get(s, 0.0) * n
                self.queued[s] += (growth or {}).get(s, 0)
                self.ctl.observe(s, now, self.busy[s], n, self.queued[s])
            plans.append(self.ctl.plan(now))
        return plans


def controller(knobs=Knobs(4, 0.5, 0.1), cfg=CFG):
    clock = ManualClock()
    ctl = OnlineController(knobs, {"encode": 1, "prefill": 1, "decode": 1}, cfg)
    return ctl, Load(ctl, clock)


def test_nothing_changes_before_a_full_window():
    ctl, load = controller()
    plans = load.run(9, {"encode": 0.99})
    assert all(p.estimates is None and not p.changes for p in plans)
    assert ctl.knobs.max_batch == 4


def test_busy_encoder_doubles_b_with_its_reason_then_waits_the_dwell():
    ctl, load = controller(Knobs(6, 0.5, 0.1))
    plans = load.run(60, {"encode": 0.95, "prefill": 0.5, "local_prefill": 0.0})
    b = [c for p in plans for c in p.changes if c.knob == "max_batch"]
    assert [(c.old, c.new, c.reason) for c in b] == [(6, 12, "encode_busy"), (12, 16, "encode_busy")]
    assert b[1].at - b[0].at >= CFG.dwell_s
    assert "0.95" in b[0].detail
    assert plans[-1].knobs.max_batch == 16 == BOUNDS.max_batch  # the bound holds at any load


def test_estimates_read_the_window():
    ctl, load = controller()
    p = load.run(15, {"encode": 0.6, "prefill": 0.3}, rate=3)[-1]
    assert p.estimates.rate == pytest.approx(3.0, rel=0.15)
    assert p.estimates.util("encode") == pytest.approx(0.6)
    assert dict(p.estimates.mix) == {"image": 1.0}


def test_remote_fraction_follows_the_less_busy_side():
    ctl, load = controller()
    plans = load.run(12, {"encode": 0.5, "local_prefill": 0.0, "prefill": 0.95})
    s = [c for p in plans for c in p.changes if c.knob == "remote_fraction"]
    assert [(c.old, c.new, c.reason) for c in s] == [(0.5, 0.4, "remote_busy")]


def test_desired_instances_grow_with_queue_and_shrink_when_idle():
    ctl, load = controller()
    plans = load.run(12, {"encode": 0.95}, growth={"encode": 2})
    assert plans[-1].desired_of("encode") == 2
    c = [c for p in plans for c in p.changes if c.knob == "instances_encode"][0]
    assert c.reason == "queue_growing" and "grows" in c.detail
    plans = load.run(80, {"encode": 0.1})  # 2 instances at 0.1: one is enough
    assert plans[-1].desired_of("encode") == 1
    assert [c.reason for p in plans for c in p.changes if c.knob == "instances_encode"] == ["stage_idle"]


def test_bounds_are_checked_with_what_to_change():
    with pytest.raises(ValueError, match="min_batch .* must be <= max_batch"):
        OnlineBounds(min_batch=8, max_batch=4)
    with pytest.raises(ValueError, match="hysteresis"):
        OnlineConfig(low_util=0.8, high_util=0.7)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.floats(0, 1.2), st.floats(0, 1.2), st.floats(0, 1.2), st.integers(-3, 3)),
                min_size=1, max_size=60))
def test_never_oscillates_and_stays_in_bounds(phases):
    """Any load (phases of 10 s each): knobs inside the bounds, one change per knob per dwell, a
    reversal only after reversal_dwell_s, so changes per hour are bounded."""
    ctl, load = controller()
    for ue, ul, ur, g in phases:
        for p in load.run(10, {"encode": ue, "local_prefill": ul, "prefill": ur, "decode": ue},
                          growth={"encode": g, "decode": g}):
            k = p.knobs
            assert BOUNDS.min_batch <= k.max_batch <= BOUNDS.max_batch
            assert BOUNDS.min_remote_fraction <= k.remote_fraction <= BOUNDS.max_remote_fraction
            assert BOUNDS.min_tolerance <= k.tolerance <= BOUNDS.max_tolerance
            assert all(BOUNDS.min_instances <= n <= BOUNDS.max_instances for _, n in p.desired)
    by_knob: dict[str, list] = {}
    for c in ctl.changes:
        by_knob.setdefault(c.knob, []).append(c)
    hours = len(phases) * 10 / 3600
    for cs in by_knob.values():
        for a, b in zip(cs, cs[1:]):
            assert b.at - a.at >= CFG.dwell_s
            grows_back = b.knob.startswith("instances_") and b.new > b.old  # capacity returns after a dwell
            if (a.new > a.old) != (b.new > b.old) and not grows_back:
                assert b.at - a.at >= CFG.reversal_dwell_s
        assert len(cs) <= hours * 3600 / CFG.dwell_s + 1
        flips = [b for a, b in zip(cs, cs[1:]) if a.new > a.old and b.new < b.old]  # growth, then a shrink
        assert len(flips) <= hours * 3600 / CFG.reversal_dwell_s + 1
