"""bench/chaos_recovery.py: seconds from a kill until the goodput is back, per kill and with the
kills superposed."""
from __future__ import annotations

import numpy as np
import pytest

from bench.chaos_recovery import epoch_recovery, good_per_s, isolated, recovery_s, window_mean


def test_a_two_second_outage_after_a_kill_recovers_when_the_goodput_comes_back_not_a_window_later():
    # 4 requests meet the SLO each second, none in seconds 11 and 12 (a kill at 10.5), 4 again from 13
    ends = [s + 0.1 + 0.2 * j for s in range(40) if s not in (11, 12) for j in range(4)]
    series = window_mean(good_per_s(ends, duration_s=40), 5)
    assert series[5] == 4.0 and series[11] == pytest.approx(0.6 * 4.0)  # seconds 11..15: two empty of five
    assert recovery_s(series, target=4.0, kills=[10.5, 25.0]) == [2.5, 1.0]  # back at 13; no dip after 25


def test_a_stack_that_never_recovers_reports_the_rest_of_the_run():
    series = window_mean(good_per_s([s + 0.5 for s in range(10)], duration_s=30), 5)  # 1 per second, then none
    assert recovery_s(series, target=1.0, kills=[12.0]) == [len(series) - 12.0]


def _runs(dip: dict[int, float], kills: list[int], n: int = 400, rate: float = 8.0, seed: int = 1):
    """Poisson good completions per second for a clean and a fault run; in the fault run each
    kill's offset o (seconds after it) keeps dip[o] of the clean run's."""
    rng = np.random.default_rng(seed)
    clean = rng.poisson(rate, n).astype(float)
    faulty = rng.poisson(rate, n).astype(float)
    for k in kills:
        for o, keep in dip.items():
            faulty[k + o] = rng.poisson(rate * keep)
    return faulty, clean


def test_superposed_kills_find_a_three_second_dip_that_no_single_window_can_resolve():
    kills = list(range(10, 390, 10))
    faulty, clean = _runs({0: 0.2, 1: 0.4, 2: 0.7}, kills)
    e = epoch_recovery(faulty, clean, kills, horizon_s=10, window_s=2)
    assert e["kills"] == len(kills)
    assert e["ratio"][0] < 0.5 and all(r > 0.9 for r in e["ratio"][3:])
    assert e["recovered_s"] == 3.0      # the window [2, 4) still holds the 0.7 second
    lo, hi = e["recovered_s_ci95"]
    assert lo <= 3.0 <= hi and hi <= 4.0
    assert 0.9 < e["ratio_before"] < 1.1


def test_a_loss_that_lasts_the_whole_cycle_is_never_recovered_not_a_slow_recovery():
    kills = list(range(10, 390, 10))
    faulty, clean = _runs({o: 0.75 for o in range(10)}, kills)
    e = epoch_recovery(faulty, clean, kills, horizon_s=10, window_s=2)
    assert e["recovered_s"] is None
    assert e["recovered_s_ci95"] == [10.0, 10.0]
    assert all(0.6 < r < 0.9 for r in e["ratio"])


def test_kills_too_near_the_ends_are_left_out_and_none_left_is_said():
    faulty, clean = _runs({}, [], n=30)
    assert epoch_recovery(faulty, clean, [1, 25], horizon_s=10, pre_s=3)["kills"] == 0
    assert epoch_recovery(faulty, clean, [1, 10, 25], horizon_s=10, pre_s=3)["kills"] == 1


def test_isolated_kills_have_no_stop_or_drain_around_them():
    assert isolated([10, 20, 30, 40], others=[35, 8], before_s=5, after_s=10) == [20]
