"""AdaptiveBatcher: property tests driven by a ManualClock event loop (a worker that finishes
every batch at once: `on_free` right after each dispatch), and the busy-worker rules.
The properties against a worker with a cost per batch are in test_batcher_worker.py."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from easerve.policy.batcher import MIN_GAP_S, RATE_HALFLIFE, AdaptiveBatcher, BatcherConfig, Dispatch
from easerve.policy.clock import ManualClock

EPS = 1e-9


def run(cfg: BatcherConfig, gaps: list[float]) -> tuple[list[Dispatch], dict[int, float], list[int]]:
    """Feed arrivals separated by `gaps`, polling exactly at every deadline like an asyncio
    loop would. Returns dispatches, arrival times and the pending count after each add."""
    b, clock = AdaptiveBatcher(cfg), ManualClock()
    out, arrived, pending_after_add = [], {}, []

    def took(x: Dispatch | None) -> None:
        if x is not None:
            out.append(x)
            b.on_free(clock.now())

    def drain_until(t: float | None) -> None:
        while (d := b.next_deadline(clock.now())) is not None and (t is None or d <= t):
            clock.advance_to(max(d, clock.now()))
            while (x := b.poll(clock.now())) is not None:
                took(x)

    for i, g in enumerate(gaps):
        drain_until(clock.now() + g)
        clock.advance(g)
        arrived[i] = clock.now()
        took(b.add(i, clock.now()))
        pending_after_add.append(b.pending)
    drain_until(None)
    assert b.pending == 0
    return out, arrived, pending_after_add


gaps_st = st.lists(st.one_of(st.floats(0, 0.05), st.floats(0, 3.0), st.just(0.0)), min_size=1, max_size=120)
cfg_st = st.builds(BatcherConfig, max_batch=st.integers(1, 12), safety_cap_s=st.floats(0.01, 2.0),
                   gap_coef=st.floats(0.1, 5.0), mode=st.sampled_from(["adaptive", "fixed", "request_at_a_time", "continuous"]),
                   max_gap_s=st.none() | st.floats(0.002, 2.0))


@settings(max_examples=150, deadline=None)
@given(cfg=cfg_st, gaps=gaps_st)
def test_dispatch_invariants(cfg: BatcherConfig, gaps: list[float]) -> None:
    out, arrived, pending_after_add = run(cfg, gaps)
    ids = [i for d in out for i in d.item_ids]
    assert sorted(ids) == list(range(len(gaps)))  # every request exactly once, none lost
    for d in out:
        assert 1 <= d.size <= cfg.max_batch
        assert all(d.at - arrived[i] <= cfg.safety_cap_s + EPS for i in d.item_ids), "held past cap"
        assert d.oldest_wait_s == pytest.approx(d.at - arrived[d.item_ids[0]])
        if d.reason == "size":  # dispatched the moment the B-th request arrived
            assert d.size == cfg.max_batch and d.at == arrived[d.item_ids[-1]]
        if cfg.mode == "request_at_a_time":
            assert d.reason == "single" and d.size == 1 and d.at == arrived[d.item_ids[0]]
        if cfg.mode == "fixed":
            assert d.reason in ("size", "cap")
        if cfg.mode == "continuous":  # a free worker takes each arrival at once
            assert d.reason in ("size", "idle") and d.at == arrived[d.item_ids[0]]
    assert max(pending_after_add) < cfg.max_batch  # a full batch never waits


@settings(max_examples=80, deadline=None)
@given(cfg=cfg_st, gaps=gaps_st, poll_every=st.floats(0.01, 1.5))
def test_late_polling_loses_nothing(cfg: BatcherConfig, gaps: list[float], poll_every: float) -> None:
    """A caller that polls on its own coarse schedule still gets every item, <= B per batch,
    and nothing waits past the cap by more than the caller's own lateness."""
    b, t, out, arrived = AdaptiveBatcher(cfg), 0.0, [], {}

    def took(x: Dispatch | None) -> None:
        if x is not None:
            out.append(x)
            b.on_free(t)

    for i, g in enumerate(gaps):
        t += g
        arrived[i] = t
        took(b.add(i, t))
        if i % 3 == 0:
            took(b.poll(t))
    while b.pending:
        t += poll_every
        while (x := b.poll(t)) is not None:
            took(x)
    assert sorted(i for d in out for i in d.item_ids) == list(range(len(gaps)))
    assert all(d.size <= cfg.max_batch for d in out)


def drain(b: AdaptiveBatcher, now: float) -> None:
    """Every batch due at `now`, each finished at once."""
    if b.busy:
        b.on_free(now)
    while b.poll(now):
        b.on_free(now)


def feed(b: AdaptiveBatcher, clock: ManualClock, rate: float, n: int) -> None:
    for _ in range(n):
        clock.advance(1.0 / rate)
        b.add(object(), clock.now())
        drain(b, clock.now())


@settings(max_examples=60, deadline=None)
@given(r1=st.floats(2.0, 250.0), r2=st.floats(2.0, 250.0), coef=st.floats(0.25, 1.0))
def test_gap_threshold_tracks_rate(r1: float, r2: float, coef: float) -> None:
    """Rates up to 250/s with coef >= 0.25: the threshold stays above MIN_GAP_S."""
    cfg = BatcherConfig(max_batch=1_000_000, safety_cap_s=1.0, gap_coef=coef)
    b, clock = AdaptiveBatcher(cfg), ManualClock()
    feed(b, clock, r1, 20)
    assert b.gap_threshold == pytest.approx(coef / r1, rel=1e-6)
    assert b.rate == pytest.approx(r1, rel=1e-6)
    feed(b, clock, r2, 20 * int(RATE_HALFLIFE))  # 20 half-lives: residual of the old rate < 1e-6 of it
    assert b.gap_threshold == pytest.approx(coef / r2, rel=1e-3)
    assert b.rate == pytest.approx(r2, rel=1e-3)


def test_rate_estimate_on_poisson_arrivals() -> None:
    rng, clock = random.Random(7), ManualClock()
    b = AdaptiveBatcher(BatcherConfig(max_batch=8, gap_coef=2.0))
    for i in range(3000):
        clock.advance(rng.expovariate(40.0))
        b.add(i, clock.now())
        drain(b, clock.now())
    assert b.rate == pytest.approx(40.0, rel=0.3)
    assert b.gap_threshold == pytest.approx(2.0 / b.rate)


def test_recovers_quickly_after_idle() -> None:
    cfg = BatcherConfig(max_batch=8, gap_coef=2.0)
    b, clock = AdaptiveBatcher(cfg), ManualClock()
    feed(b, clock, 100.0, 100)
    clock.advance(600.0)  # ten idle minutes
    feed(b, clock, 100.0, 80)
    assert b.gap_threshold == pytest.approx(2.0 / 100.0, rel=0.1)


def test_deadline_is_exact_and_gap_dispatch() -> None:
    b = AdaptiveBatcher(BatcherConfig(max_batch=4, gap_coef=2.0))
    assert b.next_deadline(0.0) is None and b.rate is None
    assert b.add("a", 0.0) is None and b.add("b", 0.1) is None
    assert b.rate == pytest.approx(10.0)
    assert b.next_deadline(0.1) == pytest.approx(0.3)  # the last arrival + 2 / lambda
    assert b.poll(0.2999) is None
    d = b.poll(b.next_deadline(0.2999))
    assert d is not None and d.item_ids == ("a", "b") and d.reason == "gap"


def test_size_dispatch_is_immediate_and_cap_applies_in_fixed_mode() -> None:
    b = AdaptiveBatcher(BatcherConfig(max_batch=3, mode="fixed", safety_cap_s=0.5))
    assert b.add(1, 0.0) is None and b.add(2, 0.1) is None
    d = b.add(3, 0.2)
    assert d == Dispatch((1, 2, 3), "size", 0.2, pytest.approx(0.2))
    b.on_free(0.3)
    b.add(4, 1.0)
    assert b.next_deadline(1.0) == pytest.approx(1.5) and b.poll(1.49) is None
    assert b.poll(1.5).reason == "cap"


def test_request_at_a_time_and_b1() -> None:
    b = AdaptiveBatcher(BatcherConfig(mode="request_at_a_time"))
    assert b.add(0, 0.0) == Dispatch((0,), "single", 0.0, 0.0)
    assert b.add(1, 0.1) is None and b.add(2, 0.2) is None  # behind the busy worker
    b.on_free(0.5)
    assert b.next_deadline(0.5) == 0.5
    assert b.poll(0.5) == Dispatch((1,), "single", 0.5, pytest.approx(0.4)) and b.poll(0.5) is None
    b.on_free(0.6)
    assert b.poll(0.6).item_ids == (2,) and b.pending == 0
    b1 = AdaptiveBatcher(BatcherConfig(max_batch=1))
    assert b1.add("x", 0.0).reason == "size"


def test_late_add_joins_expired_batch() -> None:
    b = AdaptiveBatcher(BatcherConfig(max_batch=8, gap_coef=1.0, safety_cap_s=2.0))
    b.add("a", 0.0)
    d = b.add("b", 5.0)  # caller never polled: the cap (2 s) had expired, and the gap
    assert d == Dispatch(("a", "b"), "cap", 5.0, 5.0)
    b.on_free(5.0)
    b.add("c", 6.0)
    t = 6.0 + b.gap_threshold + 0.01
    assert t < 6.0 + 2.0
    d = b.add("d", t)  # only the gap after c had expired, not c's cap
    assert d == Dispatch(("c", "d"), "gap", t, pytest.approx(t - 6.0))


def test_simultaneous_burst_stays_together() -> None:
    b = AdaptiveBatcher(BatcherConfig(max_batch=8))
    assert all(b.add(i, 0.0) is None for i in range(5))
    assert b.poll(0.0) is None and b.gap_threshold == MIN_GAP_S
    assert b.poll(b.next_deadline(0.0)).item_ids == tuple(range(5))


def test_busy_worker_accumulates_and_what_is_due_leaves_when_it_frees() -> None:
    b = AdaptiveBatcher(BatcherConfig(max_batch=4, gap_coef=1.0, safety_cap_s=1.0))
    assert b.add("a", 0.0) is None and b.flush(0.01) == Dispatch(("a",), "flush", 0.01, pytest.approx(0.01))
    assert b.busy
    for i, t in enumerate((0.02, 0.03, 0.04, 0.05, 0.06)):  # 5 arrive while "a" encodes: full, not dispatched
        assert b.add(i, t) is None
    assert b.poll(0.5) is None and b.next_deadline(0.5) is None and b.pending == 5
    b.on_free(0.5)
    assert b.poll(0.5) == Dispatch((0, 1, 2, 3), "size", 0.5, pytest.approx(0.48))  # oldest first, up to B
    assert b.add(9, 0.598) is None
    b.on_free(0.6)  # 4 and 9 pending; 9 arrived 2 ms ago, less than the gap threshold: the idle worker waits
    assert b.gap_threshold > 0.002
    assert b.poll(0.6) is None and b.next_deadline(0.6) == pytest.approx(0.598 + b.gap_threshold)
    assert b.poll(b.next_deadline(0.6)).item_ids == (4, 9)


def test_cap_expired_while_busy_leaves_at_free() -> None:
    b = AdaptiveBatcher(BatcherConfig(max_batch=8, mode="fixed", safety_cap_s=0.5))
    b.add("x", 0.0)
    assert b.flush(0.0).item_ids == ("x",)  # the worker is now busy
    b.add("y", 0.1)
    b.add("z", 0.2)
    assert b.poll(2.0) is None  # past y's cap, but the worker is still busy
    b.on_free(2.0)
    assert b.poll(2.0) == Dispatch(("y", "z"), "cap", 2.0, pytest.approx(1.9))


def test_continuous_has_no_timer() -> None:
    b = AdaptiveBatcher(BatcherConfig(max_batch=3, mode="continuous", safety_cap_s=5.0))
    assert b.next_deadline(0.0) is None
    assert b.add("a", 0.0) == Dispatch(("a",), "idle", 0.0, 0.0)  # an idle worker takes it at once
    assert [b.add(i, 0.1 * i) for i in range(1, 5)] == [None] * 4  # busy: accumulate
    assert b.next_deadline(0.4) is None
    b.on_free(0.7)
    assert b.next_deadline(0.7) == 0.7
    assert b.poll(0.7) == Dispatch((1, 2, 3), "size", 0.7, pytest.approx(0.6))
    b.on_free(0.8)
    assert b.poll(0.8) == Dispatch((4,), "idle", 0.8, pytest.approx(0.4)) and b.pending == 0


def test_on_free_needs_a_dispatch() -> None:
    b = AdaptiveBatcher(BatcherConfig())
    with pytest.raises(RuntimeError, match="once per Dispatch"):
        b.on_free(0.0)


def test_flush_remove_and_clock_checks() -> None:
    b = AdaptiveBatcher(BatcherConfig(max_batch=8))
    for i in range(3):
        b.add(i, 0.0)
    assert b.remove(1) and not b.remove(99)
    assert b.flush(0.0).item_ids == (0, 2) and b.flush(0.0) is None
    with pytest.raises(ValueError, match="backwards"):
        b.poll(-1.0)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_batch": 0}, "max_batch"), ({"max_batch": 2.5}, "max_batch"),
    ({"safety_cap_s": 0}, "safety_cap_s"), ({"gap_coef": -1}, "gap_coef"),
    ({"mode": "greedy"}, "mode"), ({"max_gap_s": 0.0005}, "floor"),
    ({"safety_cap_s": 0.0005}, "floor"), ({"max_gap_s": float("nan")}, "max_gap_s"),
])
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BatcherConfig(**kwargs)


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        BatcherConfig().max_batch = 4  # type: ignore[misc]
