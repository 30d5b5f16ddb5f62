"""The decode stream's coalescing rule (easerve.stages.decode.stream_interval), on a fake clock."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from easerve.stages.decode.stream_interval import Coalescer


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _sent(chunks):
    return [(c.choice, c.ids, c.text, c.finished) for c in chunks]


def test_first_token_at_once_then_held_until_the_interval_and_the_finish_takes_the_rest():
    clock = Clock()
    c = Coalescer(0.020, clock)
    assert _sent(c.add(0, [1], "a", [], False)) == [(0, [1], "a", False)]  # never held
    clock.t += 0.005
    assert c.add(0, [2], "b", [], False) == []
    clock.t += 0.005
    assert c.add(0, [3], "c", [], False) == []
    clock.t += 0.011  # 21 ms since the last send: this output sends all three held
    assert _sent(c.add(0, [4], "d", [], False)) == [(0, [2, 3, 4], "bcd", False)]
    clock.t += 0.001
    assert c.add(0, [5], "e", [], False) == []
    clock.t += 0.001
    assert _sent(c.add(0, [6], "f", ["lp"], True)) == [(0, [5, 6], "ef", True)]  # the finish never waits


def test_zero_interval_sends_every_output_and_slow_steps_are_never_held():
    clock = Clock()
    c0 = Coalescer(0.0, clock)
    slow = Coalescer(0.020, clock)
    for i in range(5):
        assert _sent(c0.add(0, [i], str(i), [], False)) == [(0, [i], str(i), False)]
        assert _sent(slow.add(0, [i], str(i), [], False)) == [(0, [i], str(i), False)]
        clock.t += 0.025  # a step slower than the interval


def test_another_choice_sends_what_is_held_first():
    clock = Clock()
    c = Coalescer(0.020, clock)
    c.add(0, [1], "a", [], False)
    clock.t += 0.001
    assert c.add(0, [2], "b", [], False) == []
    assert _sent(c.add(1, [7], "x", [], False)) == [(0, [2], "b", False)]  # choice 1's is held now
    assert _sent(c.add(1, [8], "y", [], True)) == [(1, [7, 8], "xy", True)]


def test_an_interval_out_of_bounds_says_what_to_change():
    with pytest.raises(ValueError, match="--stream-interval-ms must be in"):
        Coalescer(2.0, Clock())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.floats(0, 0.05)), min_size=1, max_size=60),
       st.floats(0, 0.1))
def test_every_token_is_sent_once_in_order_per_choice_and_none_waits_past_the_next_output(steps, interval):
    clock = Clock()
    c = Coalescer(interval, clock)
    got: dict[int, list[int]] = {}
    want: dict[int, list[int]] = {}
    held_since: float | None = None
    for k, (choice, dt) in enumerate(steps):
        last = k == len(steps) - 1
        clock.t += dt
        want.setdefault(choice, []).append(k)
        out = c.add(choice, [k], "", [], last)
        for ch in out:
            got.setdefault(ch.choice, []).extend(ch.ids)
        if out:
            held_since = None
        elif held_since is None:
            held_since = clock.t
        else:  # held across outputs only while the interval has not passed since the last send
            assert clock.t - held_since < interval + 1e-9
    assert got == want
