"""SMPartitioner: the latency grid (measured, or from profile points), per-batch choice, baselines, validation."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from easerve.policy.partitioner import DEFAULT_SHARES, Allocation, LatencyGrid, PartitionerConfig, SMPartitioner, measure_grid


def saturating(b: int, share: float) -> float:
    """Fake encoder: batch b needs min(1, 0.15*b) of the device; less share slows it down."""
    need = min(1.0, 0.15 * b)
    return 0.01 * b / min(1.0, share / need)


def test_measure_grid_calls_measure_fn_per_cell_and_takes_median() -> None:
    calls: list[tuple[int, float]] = []
    values = iter([3.0, 1.0, 2.0] * 100)

    def measure(b: int, s: float) -> float:
        calls.append((b, s))
        return next(values)

    t = measure_grid(measure, [4, 1, 2], repeats=3)
    assert t.batch_sizes == (1, 2, 4) and t.shares == DEFAULT_SHARES
    assert len(calls) == 3 * 5 * 3 and all(v == 2.0 for row in t.latency_s for v in row)


def test_dynamic_small_batches_release_sms_large_ones_reclaim() -> None:
    p = SMPartitioner(measure_grid(saturating, [1, 2, 4, 8]), PartitionerConfig(tolerance=0.05))
    got = {b: p.choose(b) for b in (1, 2, 4, 8)}
    assert got[1] == Allocation(0.2, 0.8, 0)     # needs 0.15
    assert got[2] == Allocation(0.4, 0.6, 1)     # needs 0.30
    assert got[4] == Allocation(0.6, 0.4, 2)     # needs 0.60
    assert got[8] == Allocation(1.0, 0.0, 4)     # needs everything: prefill only time-slices
    assert p.choose(3) == got[4] and p.choose(100) == got[8]  # nearest, ties go larger


def test_baseline_policies() -> None:
    t = measure_grid(saturating, [1, 8])
    assert SMPartitioner(t, PartitionerConfig(policy="static")).choose(8) == Allocation(0.5, 0.5, None)
    assert SMPartitioner(t, PartitionerConfig(policy="timeslice")).choose(1) == Allocation(1.0, 1.0, None)


tables = st.integers(1, 6).flatmap(lambda nb: st.integers(1, 5).flatmap(lambda ns: st.tuples(
    st.lists(st.integers(1, 256), min_size=nb, max_size=nb, unique=True).map(sorted),
    st.lists(st.floats(0.01, 0.99), min_size=ns - 1, max_size=ns - 1, unique=True).map(
        lambda xs: sorted(xs) + [1.0]),
    st.lists(st.lists(st.floats(1e-4, 10.0), min_size=ns, max_size=ns), min_size=nb, max_size=nb))))


@settings(max_examples=200, deadline=None)
@given(tab=tables, tol=st.floats(0.0, 1.0), b=st.integers(1, 300))
def test_choice_is_smallest_share_within_tolerance(tab, tol: float, b: int) -> None:
    bs, shares, lat = tab
    t = LatencyGrid(tuple(bs), tuple(shares), tuple(map(tuple, lat)))
    p = SMPartitioner(t, PartitionerConfig(tolerance=tol))
    a = p.choose(b)
    nearest = min(bs, key=lambda x: (abs(x - b), -x))
    row = lat[bs.index(nearest)]
    j = a.level_index
    assert shares[j] == a.encode_share and a.prefill_share == pytest.approx(1 - a.encode_share)
    assert row[j] <= (1 + tol) * row[-1]
    assert all(row[k] > (1 + tol) * row[-1] for k in range(j))
    assert LatencyGrid.from_points(reversed(t.points())) == t  # the profile file's points, in any order


@pytest.mark.parametrize("points, match", [
    ([(1, 1.0, 0.1), (8, 0.5, 0.2), (8, 1.0, 0.1)], r"no point at batch 1, share 0.5"),
    ([(1, 0.5, 0.2), (8, 0.5, 0.1)], "must end with 1.0"),
    ([(1, 1.0, -0.1)], "> 0"),
    ([], "must not be empty"),
])
def test_from_points_rejects_incomplete_or_bad_grids(points, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LatencyGrid.from_points(points)


@pytest.mark.parametrize("mutate, match", [
    (lambda g: LatencyGrid(g.batch_sizes, (0.5, 0.2, 1.0, 0.8, 0.6), g.latency_s), "increasing"),
    (lambda g: LatencyGrid(g.batch_sizes, (0.2, 0.4, 0.6, 0.8, 0.9), g.latency_s), "1.0"),
    (lambda g: LatencyGrid((1, 1), g.shares, g.latency_s), "increasing"),
    (lambda g: LatencyGrid(g.batch_sizes, g.shares, g.latency_s[:1]), "rows"),
    (lambda g: LatencyGrid(g.batch_sizes, g.shares, ((-1.0,) * 5, g.latency_s[1])), "> 0"),
    (lambda g: LatencyGrid(g.batch_sizes, g.shares, ((0.1,) * 4, g.latency_s[1])), "one per share"),
])
def test_grid_rejects_bad_shapes(mutate, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mutate(measure_grid(saturating, [1, 8]))


def test_configs_and_allocations_validate() -> None:
    with pytest.raises(ValueError, match="policy"):
        PartitionerConfig(policy="greedy")
    with pytest.raises(ValueError, match="tolerance"):
        PartitionerConfig(tolerance=-0.1)
    with pytest.raises(ValueError, match="encode_share"):
        Allocation(0.0, 1.0)
    with pytest.raises(ValueError, match="prefill_share"):
        Allocation(0.5, 1.5)
    with pytest.raises(ValueError, match="batch_size"):
        SMPartitioner(measure_grid(saturating, [1])).choose(0)
    with pytest.raises(ValueError, match="repeats"):
        measure_grid(saturating, [1], repeats=0)
