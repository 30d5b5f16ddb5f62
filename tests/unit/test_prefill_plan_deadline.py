"""PrefillBatcher's deadline order: requests that can still meet their SLO tier are planned
first, earliest deadline first, under the same token budget; best-effort / batch requests and
requests past their deadline wait, in arrival order, and are overtaken only by requests that
can still meet their tier. Work-conserving: a free worker with a queue always gets a plan."""
from __future__ import annotations

import math

from hypothesis import given, settings, strategies as st

from easerve.policy.prefill_plan import PrefillBatchConfig, PrefillBatcher


def busy_planner(max_tokens: int = 100, max_size: int = 8) -> PrefillBatcher:
    """A planner whose worker is busy (a first request was planned at t=0), so arrivals queue."""
    b = PrefillBatcher(PrefillBatchConfig(max_batched_tokens=max_tokens, max_batch_size=max_size))
    b.add("first", 1, 0.0)
    assert b.next_batch(0.0).request_ids == ("first",)
    return b


def plan_at(b: PrefillBatcher, now: float):
    b.on_free(now)
    return b.next_batch(now)


def test_best_effort_and_batch_requests_wait_for_the_ones_that_can_meet_their_tier():
    b = busy_planner(max_size=2)
    b.add("best-effort", 10, 0.1, deadline=2.0, yields=True)
    b.add("batch-class", 10, 0.2, yields=True)
    b.add("due-late", 10, 0.3, deadline=5.0)
    b.add("due-soon", 10, 0.4, deadline=3.0)
    p = plan_at(b, 1.0)
    assert p.request_ids == ("due-soon", "due-late")
    assert p.oldest_wait_s == 1.0 - 0.3          # the oldest of the batch, not of the queue
    assert plan_at(b, 2.0).request_ids == ("best-effort", "batch-class")


def test_a_request_past_its_deadline_goes_after_the_no_tier_ones_in_arrival_order():
    b = busy_planner(max_size=1)
    b.add("missed-1", 10, 0.1, deadline=0.5)
    b.add("no-tier", 10, 0.2)
    b.add("missed-2", 10, 0.3, deadline=0.6)
    b.add("on-time", 10, 0.4, deadline=9.0)
    assert [plan_at(b, t).request_ids for t in (1.0, 1.1, 1.2, 1.3)] == [
        ("on-time",), ("no-tier",), ("missed-1",), ("missed-2",)]


def test_the_token_budget_holds_in_deadline_order_and_nothing_behind_a_misfit_jumps_ahead():
    b = busy_planner(max_tokens=100, max_size=8)
    b.add("be-small", 5, 0.1, yields=True)
    b.add("soon-60", 60, 0.2, deadline=2.0)
    b.add("later-50", 50, 0.3, deadline=4.0)
    b.add("latest-10", 10, 0.4, deadline=6.0)
    assert plan_at(b, 1.0).request_ids == ("soon-60",)                # 60 + 50 > 100 ends the batch
    assert plan_at(b, 1.5).request_ids == ("later-50", "latest-10", "be-small")


def test_a_deadline_that_passes_while_queued_moves_the_request_back():
    b = busy_planner(max_size=1)
    b.add("tight", 10, 0.1, deadline=1.5)
    b.add("loose", 10, 0.2, deadline=8.0)
    assert plan_at(b, 2.0).request_ids == ("loose",)   # "tight" can no longer meet its tier
    assert plan_at(b, 2.1).request_ids == ("tight",)


# one queued request: (prompt tokens, deadline or None, yields, arrival gap)
req_st = st.tuples(st.integers(1, 120), st.one_of(st.none(), st.floats(0.0, 6.0)), st.booleans(),
                   st.floats(0.0, 0.3))


@settings(max_examples=300, deadline=None)
@given(reqs=st.lists(req_st, min_size=1, max_size=25), max_tokens=st.integers(1, 200),
       max_size=st.integers(1, 6), step=st.floats(0.01, 1.0), late=st.lists(req_st, max_size=10))
def test_no_yielding_or_late_request_is_planned_while_one_that_can_meet_its_tier_waits(
        reqs, max_tokens, max_size, step, late):
    """Draws plans until the queue is empty (more requests arrive after the first plan). In every
    plan: if a request that can meet its tier at that `now` stays queued, every planned request
    can meet its tier and is due no later than it; requests that cannot meet theirs keep arrival
    order among themselves; budgets hold; the worker never idles with a queue; nothing is lost."""
    b = busy_planner(max_tokens, max_size)
    info, now = {}, 0.0

    def arrive(batch, start):
        nonlocal now
        for k, (tokens, deadline, yields, gap) in enumerate(batch, start):
            now += gap
            b.add(k, tokens, now, deadline=deadline, yields=yields)
            info[k] = (tokens, math.inf if deadline is None else deadline, yields)

    arrive(reqs, 0)
    queued, served, plans = set(info), [], 0
    while queued:
        now += step
        b.on_free(now)
        plan = b.next_batch(now)
        assert plan is not None and b.busy                          # work-conserving
        plans += 1
        got = list(plan.request_ids)
        meets = {k for k in queued if not info[k][2] and info[k][1] >= now}
        left_meeting = meets - set(got)
        if left_meeting:
            assert set(got) <= meets
            assert max(info[k][1] for k in got) <= min(info[k][1] for k in left_meeting)
        others = [k for k in got if k not in meets]
        waiting_others = sorted(k for k in queued - meets)
        assert others == waiting_others[:len(others)]               # arrival order among them
        assert 1 <= len(got) <= max_size
        assert sum(info[k][0] for k in got) <= max_tokens or len(got) == 1
        assert plan.num_tokens == tuple(info[k][0] for k in got)
        queued -= set(got)
        served += got
        if plans == 1 and late:
            arrive(late, len(reqs))
            queued |= set(range(len(reqs), len(reqs) + len(late)))
    assert sorted(served) == sorted(info) and b.pending == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=20), st.integers(1, 100), st.integers(1, 5))
def test_requests_without_deadlines_keep_arrival_order(tokens, max_tokens, max_size):
    b = busy_planner(max_tokens, max_size)
    for k, n in enumerate(tokens):
        b.add(k, n, 0.01 * (k + 1))
    served, t = [], 1.0
    while b.pending:
        served += plan_at(b, t).request_ids
        t += 1.0
    assert served == list(range(len(tokens)))


def test_removing_a_request_forgets_its_deadline():
    b = busy_planner(max_size=1)
    b.add("x", 10, 0.1, deadline=2.0)
    b.add("y", 10, 0.2, yields=True)
    assert b.remove("x")
    b.add("x", 10, 0.3, yields=True)  # the same id again, now yielding: no stale deadline
    b.add("z", 10, 0.4)
    assert [plan_at(b, t).request_ids for t in (1.0, 1.1, 1.2)] == [("z",), ("y",), ("x",)]


def test_overdue_counts_the_queued_requests_the_order_puts_last_as_their_deadlines_pass():
    b = busy_planner(max_tokens=100, max_size=1)
    b.add("be", 10, 0.1, yields=True)
    b.add("due-1", 10, 0.2, deadline=1.0)
    b.add("no-tier", 10, 0.3)
    assert [b.overdue(t) for t in (0.5, 2.0)] == [1, 2]
    assert plan_at(b, 2.0).request_ids == ("no-tier",)
    assert b.overdue(2.0) == 2 and b.pending == 2
