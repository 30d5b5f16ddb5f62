"""PrefillBatcher: FCFS batches under a token budget; property tests over random queues,
interleaved arrivals, cancellations and draws, driven by a ManualClock; `take` runs each
batch at once (on_free right after it), the busy-worker rule has its own test."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from easerve.policy.clock import ManualClock
from easerve.policy.prefill_plan import PrefillBatchConfig, PrefillBatcher, PrefillBatchPlan, take_fcfs

cfg_st = st.builds(PrefillBatchConfig, max_batched_tokens=st.integers(1, 300), max_batch_size=st.integers(1, 10))
# one event: ("add", tokens) | ("take",) | ("cancel", index among ids added so far) | ("wait", seconds)
event_st = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 400)),
    st.tuples(st.just("take")),
    st.tuples(st.just("cancel"), st.integers(0, 60)),
    st.tuples(st.just("wait"), st.floats(0, 2)),
)


def take(b: PrefillBatcher, now: float) -> PrefillBatchPlan | None:
    """The next batch, its worker done with it at once."""
    plan = b.next_batch(now)
    if plan is not None:
        b.on_free(now)
    return plan


def replay(cfg: PrefillBatchConfig, events) -> tuple[list[PrefillBatchPlan], dict[int, int], set[int], PrefillBatcher]:
    """Run the events, then drain. Returns the plans, tokens per id, cancelled ids, batcher."""
    b, clock = PrefillBatcher(cfg), ManualClock()
    plans, tokens, cancelled, next_id = [], {}, set(), 0
    for ev in events:
        if ev[0] == "add":
            tokens[next_id] = ev[1]
            b.add(next_id, ev[1], clock.now())
            next_id += 1
        elif ev[0] == "take":
            was_pending = b.pending
            plan = take(b, clock.now())
            assert (plan is None) == (was_pending == 0)
            plans += [plan] if plan else []
        elif ev[0] == "cancel":
            rid = ev[1] % max(next_id, 1)
            if b.remove(rid):
                cancelled.add(rid)
        else:
            clock.advance(ev[1])
    while (plan := take(b, clock.now())) is not None:
        plans.append(plan)
    return plans, tokens, cancelled, b


@settings(max_examples=300, deadline=None)
@given(cfg=cfg_st, events=st.lists(event_st, max_size=80))
def test_budget_order_and_nothing_lost_or_duplicated(cfg, events):
    plans, tokens, cancelled, b = replay(cfg, events)
    served = [rid for p in plans for rid in p.request_ids]
    assert len(served) == len(set(served))                                  # no duplicates
    assert set(served) == set(tokens) - cancelled                           # nothing lost
    assert served == sorted(served)                                         # FCFS: arrival order kept
    assert b.pending == 0 and b.next_batch(1e9) is None
    for p in plans:
        assert 1 <= p.size <= cfg.max_batch_size
        assert p.num_tokens == tuple(tokens[r] for r in p.request_ids)
        assert p.total_tokens <= cfg.max_batched_tokens or (p.size == 1 and p.oversized(cfg))
        assert p.oldest_wait_s >= 0


@settings(max_examples=300, deadline=None)
@given(cfg=cfg_st, sizes=st.lists(st.integers(1, 400), min_size=1, max_size=40))
def test_each_batch_is_maximal(cfg, sizes):
    """A batch stops only where the next request would break a limit (no needless splits)."""
    b = PrefillBatcher(cfg)
    for i, n in enumerate(sizes):
        b.add(i, n, 0.0)
    start = 0
    while (plan := take(b, 0.0)) is not None:
        end = start + plan.size
        assert plan.request_ids == tuple(range(start, end))
        if end < len(sizes):
            assert plan.size == cfg.max_batch_size or plan.total_tokens + sizes[end] > cfg.max_batched_tokens
        start = end
    assert start == len(sizes)


def test_oversized_request_runs_alone_when_it_reaches_the_head():
    cfg = PrefillBatchConfig(max_batched_tokens=100, max_batch_size=8)
    b = PrefillBatcher(cfg)
    for rid, n in (("a", 60), ("big", 500), ("c", 30), ("d", 30)):
        b.add(rid, n, 0.0)
    plans = [take(b, 1.0), take(b, 2.0), take(b, 3.0)]
    assert [p.request_ids for p in plans] == [("a",), ("big",), ("c", "d")]
    assert [p.oversized(cfg) for p in plans] == [False, True, False]
    assert [p.oldest_wait_s for p in plans] == [1.0, 2.0, 3.0]
    assert b.next_batch(4.0) is None


def test_take_fcfs_counts_and_limits():
    cfg = PrefillBatchConfig(max_batched_tokens=10, max_batch_size=3)
    assert take_fcfs([], cfg) == 0
    assert take_fcfs([50], cfg) == 1                 # oversized head still goes
    assert take_fcfs([4, 6, 1], cfg) == 2            # 4 + 6 = 10 fits, + 1 does not
    assert take_fcfs([1, 1, 1, 1], cfg) == 3         # size limit
    assert take_fcfs([3, 9, 1], cfg) == 1            # no skipping ahead of the 9


def test_remove_and_pending():
    b = PrefillBatcher(PrefillBatchConfig(max_batched_tokens=100))
    b.add("a", 10, 0.0)
    b.add("b", 20, 0.0)
    assert (b.pending, b.pending_tokens) == (2, 30)
    assert b.remove("a") and not b.remove("a") and not b.remove("zzz")
    assert take(b, 0.0).request_ids == ("b",)
    b.add("a", 5, 0.0)  # an id may come back once it has left the queue
    assert take(b, 0.0).request_ids == ("a",)


def test_a_busy_worker_lets_arrivals_accumulate_into_the_next_batch():
    b = PrefillBatcher(PrefillBatchConfig(max_batched_tokens=100, max_batch_size=3))
    b.add("a", 10, 0.0)
    assert b.next_batch(0.0).request_ids == ("a",) and b.busy
    for i in range(4):  # arrive while "a" runs
        b.add(i, 10, 0.1 * (i + 1))
    assert b.next_batch(1.0) is None and b.pending == 4
    b.on_free(1.0)
    plan = b.next_batch(1.0)
    assert plan.request_ids == (0, 1, 2) and plan.oldest_wait_s == pytest.approx(0.9)
    assert b.next_batch(1.0) is None  # busy again
    b.on_free(2.0)
    assert b.next_batch(2.0).request_ids == (3,)
    with pytest.raises(RuntimeError, match="once per plan"):
        b.on_free(3.0), b.on_free(3.0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_batched_tokens=0), "max_batched_tokens must be an int >= 1"),
    (dict(max_batched_tokens=2.5), "max_batched_tokens must be an int >= 1"),
    (dict(max_batch_size=0), "max_batch_size must be an int >= 1"),
    (dict(max_batch_size=True), "max_batch_size must be an int >= 1"),
])
def test_bad_config_says_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrefillBatchConfig(**kwargs)


def test_bad_calls_are_refused():
    b = PrefillBatcher()
    b.add("a", 1, 5.0)
    with pytest.raises(ValueError, match="already queued"):
        b.add("a", 3, 5.0)
    with pytest.raises(ValueError, match="num_tokens must be an int >= 1"):
        b.add("z", 0, 5.0)
    with pytest.raises(ValueError, match="must not go backwards"):
        b.next_batch(4.0)
    with pytest.raises(ValueError, match="must not go backwards"):
        b.add("y", 1, float("nan"))
