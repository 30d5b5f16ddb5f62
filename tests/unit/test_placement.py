"""Least-outstanding-work placement over the instances of a stage."""
from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from easerve.policy.placement import Candidate, LeastLoaded


def test_least_loaded_wins_and_counts_what_was_sent_since_the_poll():
    p = LeastLoaded()
    cands = [Candidate("a", True, reported=3), Candidate("b", True, reported=1, sent_since=3),
             Candidate("c", True, reported=2)]
    assert p.choose(cands) == "c"


def test_down_instances_are_skipped_and_none_when_all_are_down():
    p = LeastLoaded()
    assert p.choose([Candidate("a", False), Candidate("b", True, reported=9)]) == "b"
    assert p.choose([Candidate("a", False)]) is None
    assert p.choose([Candidate("a", True)], exclude=frozenset({"a"})) is None


def test_ties_share_evenly():
    p = LeastLoaded()
    picks = Counter(p.choose([Candidate("a", True), Candidate("b", True)]) for _ in range(10))
    assert picks == {"a": 5, "b": 5}


def test_full_instances_only_when_every_one_is_full():
    p = LeastLoaded()
    assert p.choose([Candidate("a", True, reported=4, capacity=4), Candidate("b", True, reported=9)]) == "b"
    assert p.choose([Candidate("a", True, reported=4, capacity=4)]) == "a"


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 50), st.integers(0, 50)), min_size=1, max_size=8))
def test_choice_is_an_up_instance_of_least_load(rows):
    cands = [Candidate(f"i{k}", up, rep, sent) for k, (up, rep, sent) in enumerate(rows)]
    got = LeastLoaded().choose(cands)
    up = [c for c in cands if c.up]
    if not up:
        assert got is None
    else:
        chosen = next(c for c in cands if c.key == got)
        assert chosen.up and chosen.load == min(c.load for c in up)
