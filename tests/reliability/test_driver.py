"""The load driver's own arithmetic (goodput windows, recovery), on hand-made outcomes."""
from __future__ import annotations

import pytest

from tests.reliability.driver import HUNG, LoadDriver, Outcome, recovery_s


def _driver(outcomes) -> LoadDriver:
    d = LoadDriver("http://127.0.0.1:1", [{"messages": []}], deadline_s=5)
    d.outcomes = outcomes
    return d


def test_goodput_counts_completions_per_window_by_end_time():
    outs = [Outcome(0, 0.0, 1.0, 200), Outcome(1, 0.5, 4.9, 200), Outcome(2, 1.0, 5.0, 200),
            Outcome(3, 2.0, 6.0, 503), Outcome(4, 3.0, 18.0, HUNG)]
    d = _driver(outs)
    assert d.goodput(5.0, since_s=0.0, until_s=10.0) == [(0.0, 0.4), (5.0, 0.2)]
    t = d.tally()
    assert (t.sent, t.completed, t.errored) == (5, 3, 2)
    assert t.by_status == {200: 3, 503: 1, HUNG: 1}
    assert [o.index for o in d.between(0.5, 2.0)] == [1, 2]


def test_recovery_is_the_end_of_the_first_good_window_after_the_kill():
    series = [(0.0, 3.0), (5.0, 3.0), (10.0, 0.2), (15.0, 2.6), (20.0, 2.8)]
    assert recovery_s(series, 2, baseline=3.0) == 15.0   # 2.8 >= 0.9 * 3.0, third window after the kill
    assert recovery_s(series, 2, baseline=3.0, fraction=0.8) == 10.0
    assert recovery_s(series[:4], 2, baseline=3.0) is None


def test_an_empty_body_list_is_refused():
    with pytest.raises(ValueError, match="at least one request body"):
        LoadDriver("http://x", [], deadline_s=1)
