"""AdaptiveBatcher's deadline order: when more items are due than a batch holds, the items
that can still meet their SLO tier go first (earliest deadline first); best-effort / batch
items and items past their deadline wait."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from easerve.policy.batcher import AdaptiveBatcher, BatcherConfig


def busy_batcher(max_batch: int = 2) -> AdaptiveBatcher:
    """A batcher whose worker is busy (a first item was dispatched at t=0), so arrivals queue."""
    b = AdaptiveBatcher(BatcherConfig(max_batch=max_batch, mode="continuous"))
    assert b.add("first", 0.0) is not None
    return b


def test_yielding_items_give_way_to_the_ones_that_can_meet_their_tier():
    b = busy_batcher()
    b.add("be-1", 0.1, yields=True)
    b.add("be-2", 0.2, deadline=9.0, yields=True)
    b.add("late-deadline", 0.3, deadline=5.0)
    b.add("early-deadline", 0.4, deadline=3.0)
    b.on_free(1.0)
    assert b.poll(1.0).item_ids == ("early-deadline", "late-deadline")
    b.on_free(2.0)
    assert b.poll(2.0).item_ids == ("be-1", "be-2")


def test_an_item_past_its_deadline_waits_behind_one_that_can_still_meet_it():
    b = busy_batcher(max_batch=1)
    b.add("missed", 0.1, deadline=0.5)
    b.add("on-time", 0.2, deadline=10.0)
    b.add("no-tier", 0.3)
    b.on_free(1.0)
    assert [b.poll(1.0).item_ids] == [("on-time",)]
    b.on_free(1.1)
    assert b.poll(1.1).item_ids == ("no-tier",)   # no deadline: can meet, due last among those
    b.on_free(1.2)
    assert b.poll(1.2).item_ids == ("missed",)


def test_without_deadlines_the_order_is_arrival_order():
    b = busy_batcher(max_batch=2)
    for k in range(5):
        b.add(k, 0.1 * (k + 1))
    taken = []
    for t in (1.0, 2.0, 3.0):
        b.on_free(t)
        taken += b.poll(t).item_ids
    assert taken == [0, 1, 2, 3, 4]


item = st.tuples(st.one_of(st.none(), st.floats(0.0, 4.0)), st.booleans())


@settings(max_examples=200, deadline=None)
@given(st.lists(item, min_size=1, max_size=20), st.integers(1, 6), st.floats(0.5, 3.0))
def test_no_yielding_or_missed_item_is_taken_while_one_that_can_meet_its_tier_waits(items, max_batch, free_at):
    b = busy_batcher(max_batch)
    meets = set()
    for k, (deadline, yields) in enumerate(items):
        b.add(k, 0.01 * (k + 1), deadline=deadline, yields=yields)
        if not yields and (deadline is None or deadline >= free_at):
            meets.add(k)
    b.on_free(free_at)
    got = b.poll(free_at).item_ids
    assert len(got) == min(max_batch, len(items))
    left_meeting = meets - set(got)
    if left_meeting:  # a can-meet item stayed queued: the batch holds can-meet items only
        assert set(got) <= meets
    can = [k for k in got if k in meets]
    dl = [items[k][0] if items[k][0] is not None else float("inf") for k in can]
    assert dl == sorted(dl)  # earliest deadline first among them
    assert b.pending == len(items) - len(got)


def test_overdue_counts_the_queued_items_the_order_puts_last_as_their_deadlines_pass():
    b = busy_batcher()
    b.add("be", 0.1, yields=True)             # yields: last at once
    b.add("due-1", 0.2, deadline=1.0)
    b.add("due-3", 0.3, deadline=3.0)
    b.add("no-tier", 0.4)                     # never overdue
    assert [b.overdue(t) for t in (0.5, 1.0, 1.5, 3.5)] == [1, 1, 2, 3]
    b.on_free(3.5)
    assert b.poll(3.5).item_ids == ("no-tier", "be")   # the one that can meet, then arrival order
    assert b.overdue(3.5) == 2                          # due-1, due-3 still queued
