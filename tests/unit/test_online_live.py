"""bench/online_live.py's per-phase goodput, the basis of its B-schedule ceiling."""
from __future__ import annotations

from bench import online_live


def test_good_requests_are_counted_in_the_phase_they_arrived_in():
    reqs = [(0.5, 1), (9.9, 2), (10.0, 3), (15.0, 4), (29.0, 5), (31.0, 6)]  # 3 phases of 10 s (31 s: the last)
    ok = {"ttft": 0.1, "tpot": 0.01}
    results = [ok, {"ttft": 0.9, "tpot": 0.01}, ok, {"refused": True}, {"ttft": 0.1, "tpot": 0.2}, ok]
    assert online_live.per_phase(reqs, results, 10.0, 3, (500.0, 50.0)) == [1, 1, 1]
    assert online_live.per_phase(reqs, results, 10.0, 3, (1000.0, 500.0)) == [2, 1, 2]
