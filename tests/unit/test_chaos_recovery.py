"""bench/chaos.py's recovery time: seconds from a kill until the goodput from then on is back."""
from __future__ import annotations

import pytest

from bench.chaos import goodput_series, recovery_s
from easerve.slo import SLO, RequestRecord


def _finished_at(seconds: list[float]) -> list[RequestRecord]:
    return [RequestRecord(index=i, modality="image", scheduled_s=t - 0.05, sent_s=t - 0.05, chunk_s=[t - 0.01],
                          end_s=t, output_tokens=1) for i, t in enumerate(seconds)]


def test_a_two_second_outage_after_a_kill_recovers_when_the_goodput_comes_back_not_a_window_later():
    # 4 requests meet the SLO each second, none in seconds 11 and 12 (a kill at 10.5), 4 again from 13
    ends = [s + 0.1 + 0.2 * j for s in range(40) if s not in (11, 12) for j in range(4)]
    series = goodput_series(_finished_at(ends), SLO(ttft_ms=1000, tpot_ms=1000), duration_s=40, window_s=5)
    assert series[5] == 4.0 and series[11] == pytest.approx(0.6 * 4.0)  # seconds 11..15: two empty of five
    assert recovery_s(series, target=4.0, kills=[10.5, 25.0]) == [2.5, 1.0]  # back at 13; no dip after 25


def test_a_stack_that_never_recovers_reports_the_rest_of_the_run():
    ends = [s + 0.5 for s in range(10)]                      # 1 per second, then nothing
    series = goodput_series(_finished_at(ends), SLO(ttft_ms=1000, tpot_ms=1000), duration_s=30, window_s=5)
    assert recovery_s(series, target=1.0, kills=[12.0]) == [len(series) - 12.0]
