"""bench/online_live.py's per-phase goodput, the basis of its B-schedule ceiling."""
from __future__ import annotations

from bench import online_live
from bench.harness.load import Reply


def reply(i: int, ttft: float, tpot: float) -> Reply:
    """A 3-token reply sent at 0 with this TTFT and TPOT (s)."""
    return Reply(i, "image", 0.0, sent_s=0.0, chunk_s=[ttft, ttft + tpot, ttft + 2 * tpot], end_s=ttft + 2 * tpot,
                 output_tokens=3)


def test_good_requests_are_counted_in_the_phase_they_arrived_in():
    reqs = [(0.5, 1), (9.9, 2), (10.0, 3), (15.0, 4), (29.0, 5), (31.0, 6)]  # 3 phases of 10 s (31 s: the last)
    refused = Reply(3, "image", 0.0, sent_s=0.0, end_s=0.01, error="refused", error_kind="http_429")
    results = [reply(0, 0.1, 0.01), reply(1, 0.9, 0.01), reply(2, 0.1, 0.01), refused, reply(4, 0.1, 0.2),
               reply(5, 0.1, 0.01)]
    assert online_live.per_phase(reqs, results, 10.0, 3, (500.0, 50.0)) == [1, 1, 1]
    assert online_live.per_phase(reqs, results, 10.0, 3, (1000.0, 500.0)) == [2, 1, 2]
