"""SMPartitioner: profile table, per-batch choice, baselines, JSON round trip and validation."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from easerve.policy.partitioner import DEFAULT_SHARES, Allocation, PartitionerConfig, ProfileTable, SMPartitioner, profile


def saturating(b: int, share: float) -> float:
    """Fake encoder: batch b needs min(1, 0.15*b) of the device; less share slows it down."""
    need = min(1.0, 0.15 * b)
    return 0.01 * b / min(1.0, share / need)


def test_profile_calls_measure_fn_per_cell_and_takes_median() -> None:
    calls: list[tuple[int, float]] = []
    values = iter([3.0, 1.0, 2.0] * 100)

    def measure(b: int, s: float) -> float:
        calls.append((b, s))
        return next(values)

    t = profile(measure, [4, 1, 2], repeats=3, device="fake")
    assert t.batch_sizes == (1, 2, 4) and t.shares == DEFAULT_SHARES and t.device == "fake"
    assert len(calls) == 3 * 5 * 3 and all(v == 2.0 for row in t.latency_s for v in row)


def test_dynamic_small_batches_release_sms_large_ones_reclaim() -> None:
    p = SMPartitioner(profile(saturating, [1, 2, 4, 8]), PartitionerConfig(tolerance=0.05))
    got = {b: p.choose(b) for b in (1, 2, 4, 8)}
    assert got[1] == Allocation(0.2, 0.8, 0)     # needs 0.15
    assert got[2] == Allocation(0.4, 0.6, 1)     # needs 0.30
    assert got[4] == Allocation(0.6, 0.4, 2)     # needs 0.60
    assert got[8] == Allocation(1.0, 0.0, 4)     # needs everything: prefill only time-slices
    assert p.choose(3) == got[4] and p.choose(100) == got[8]  # nearest, ties go larger


def test_baseline_policies() -> None:
    t = profile(saturating, [1, 8])
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
    t = ProfileTable(tuple(bs), tuple(shares), tuple(map(tuple, lat)))
    p = SMPartitioner(t, PartitionerConfig(tolerance=tol))
    a = p.choose(b)
    nearest = min(bs, key=lambda x: (abs(x - b), -x))
    row = lat[bs.index(nearest)]
    j = a.level_index
    assert shares[j] == a.encode_share and a.prefill_share == pytest.approx(1 - a.encode_share)
    assert row[j] <= (1 + tol) * row[-1]
    assert all(row[k] > (1 + tol) * row[-1] for k in range(j))
    assert ProfileTable.from_json(t.to_json()) == t


@pytest.mark.parametrize("mutate, match", [
    (lambda d: "not json{", "valid JSON"),
    (lambda d: {**d, "format": "other"}, "not an SM profile"),
    (lambda d: {**d, "version": 99}, "version"),
    (lambda d: {k: v for k, v in d.items() if k != "shares"}, "shares"),
    (lambda d: {**d, "shares": [0.5, 0.2, 1.0, 0.8, 0.6]}, "increasing"),
    (lambda d: {**d, "shares": [0.2, 0.4, 0.6, 0.8, 0.9]}, "1.0"),
    (lambda d: {**d, "batch_sizes": [1, 1]}, "increasing"),
    (lambda d: {**d, "latency_s": d["latency_s"][:1]}, "rows"),
    (lambda d: {**d, "latency_s": [[-1.0] * 5, d["latency_s"][1]]}, "> 0"),
    (lambda d: {**d, "latency_s": [[0.1] * 4, d["latency_s"][1]]}, "one per share"),
    (lambda d: {**d, "latency_s": [1, 2]}, "list of lists"),
])
def test_from_json_rejects_bad_profiles(mutate, match: str) -> None:
    d = json.loads(profile(saturating, [1, 8]).to_json())
    bad = mutate(d)
    with pytest.raises(ValueError, match=match):
        ProfileTable.from_json(bad if isinstance(bad, str) else json.dumps(bad))


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
        SMPartitioner(profile(saturating, [1])).choose(0)
    with pytest.raises(ValueError, match="repeats"):
        profile(saturating, [1], repeats=0)
