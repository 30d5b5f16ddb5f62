"""DeficitRouter keeps |remote - s*n| <= 1/2 at every prefix; RandomRouter does not."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from easerve.policy.router import DeficitRouter, RandomRouter, max_prefix_error

fractions = st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 1.0, 0.5, 1 / 3, 0.1, 0.999999]),
                      st.fractions(0, 1, max_denominator=50).map(float))


@settings(max_examples=300, deadline=None)
@given(s=fractions, n=st.integers(1, 3000))
def test_deficit_bound_at_every_prefix(s: float, n: int) -> None:
    r = DeficitRouter(s)
    for k in range(1, n + 1):
        r.route()
        assert abs(r.remote_count - s * k) <= 0.5 + 1e-9, (s, k, r.remote_count)
        assert r.routed == k and r.local_count == k - r.remote_count
    assert abs(r.error) <= 0.5 + 1e-9


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 500))
def test_extremes(n: int) -> None:
    zero, one = DeficitRouter(0.0), DeficitRouter(1.0)
    assert [zero.route() for _ in range(n)] == ["local"] * n
    assert [one.route() for _ in range(n)] == ["remote"] * n


def test_no_bursts_at_half() -> None:
    r = DeficitRouter(0.5)
    routes = [r.route() for _ in range(10)]
    assert all(a != b for a, b in zip(routes, routes[1:]))  # strict alternation


def test_random_baseline_is_seeded_and_drifts() -> None:
    r1, r2 = RandomRouter(0.3, seed=1), RandomRouter(0.3, seed=1)
    assert [r1.route() for _ in range(200)] == [r2.route() for _ in range(200)]
    rand, det = RandomRouter(0.3, seed=0), DeficitRouter(0.3)
    rr = [rand.route() for _ in range(5000)]
    dd = [det.route() for _ in range(5000)]
    assert max_prefix_error(dd, 0.3) <= 0.5 + 1e-9
    assert max_prefix_error(rr, 0.3) > 2.0  # Bernoulli drift ~ sqrt(n); the point of the deficit


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.5", True])
def test_rejects_bad_fraction(bad) -> None:
    with pytest.raises(ValueError, match="fraction"):
        DeficitRouter(bad)
    with pytest.raises(ValueError, match="fraction"):
        RandomRouter(bad)
