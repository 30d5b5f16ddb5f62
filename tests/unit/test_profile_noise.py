"""bench/profile_noise.py's comparison of profiles of one checkpoint taken back to back."""
from __future__ import annotations

import math

import pytest

from bench.profile_noise import compare, points
from tests.support.profiles import make_profile


def test_every_stage_of_a_profile_is_compared_point_by_point():
    fast, slow = points(make_profile()), points(make_profile(encode_s_per_item=0.2, prefill_tok_s=500.0))
    got = compare([fast, slow, fast])
    assert got["points"]["prefill"] == len([k for k in fast if k[0] == "prefill"]) > 0
    # the pairs (fast, slow), (fast, fast), (slow, fast): two of three differ by 2x
    assert got["pairwise_abs_log_median"]["prefill"] == pytest.approx(math.log(2), abs=1e-4)
    assert got["pairwise_abs_log_median"]["encode_grid"] == pytest.approx(math.log(2), abs=1e-4)
    assert got["pairwise_abs_log_median"]["decode"] == 0.0  # decode_tok_s unchanged
    assert got["spread_median"]["prefill"] == pytest.approx(2.0)
