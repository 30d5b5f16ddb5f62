"""Per-micro-batch compute partitioning between encode and co-located prefill.

A `LatencyGrid` holds encode latency over batch sizes x share levels. It comes from an
`easerve.profile/v1` file's encode grid (`LatencyGrid.from_points`), or from `measure_grid()`,
which measures every cell through an injected `measure_fn(batch_size, share) -> seconds` (the
encode profiler in the service, a formula in tests and benchmarks).
`SMPartitioner.choose(batch_size)` then returns, per batch, the `Allocation` that the backend
in `easerve.partition.backends` realizes:

- "dynamic":   the smallest share whose latency <= (1 + tolerance) x exclusive (share 1.0)
               latency; prefill gets the rest (0 at share 1.0: prefill then only time-slices)
- "static":    always `static_share` (0.5: the paper's static 50/50 baseline); the backend is
               built with that one level (`policy_levels`), so it realizes the split itself
               rather than the nearest profiled level
- "timeslice": no partition; both sides may use the whole device (uncontrolled baseline)

The two baselines need no grid (`SMPartitioner(None, config)`). `FixedPartitioner` is for a
backend whose split is fixed at launch (MPS, the static backend): it has nothing to choose.

Pure: no torch, no I/O.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Annotated, Callable, Iterable, Literal, Sequence, get_args

from pydantic import Field

from easerve.fields import NonNegFloat, check_fields

DEFAULT_SHARES: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8, 1.0)

Policy = Literal["dynamic", "static", "timeslice"]  # --partition-policy
POLICIES: tuple[str, ...] = get_args(Policy)
MeasureFn = Callable[[int, float], float]


@dataclass(frozen=True)
class Allocation:
    """Compute shares for the next micro-batch. `level_index` indexes the grid's shares
    (None when the share is not a profiled level, e.g. the baselines)."""

    encode_share: float
    prefill_share: float
    level_index: int | None = None

    def __post_init__(self) -> None:
        for name in ("encode_share", "prefill_share"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v <= 1.0):
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        if self.encode_share == 0.0:
            raise ValueError("encode_share must be > 0: encode is the critical path")


TIMESLICE = Allocation(1.0, 1.0, None)


@dataclass(frozen=True)
class LatencyGrid:
    """latency_s[i][j]: encode latency at batch_sizes[i] and shares[j] (seconds)."""

    batch_sizes: tuple[int, ...]
    shares: tuple[float, ...]
    latency_s: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        _check_batch_sizes(self.batch_sizes)
        _check_shares(self.shares)
        if len(self.latency_s) != len(self.batch_sizes):
            raise ValueError(f"latency_s has {len(self.latency_s)} rows, expected one per batch "
                             f"size ({len(self.batch_sizes)})")
        for b, row in zip(self.batch_sizes, self.latency_s):
            if len(row) != len(self.shares):
                raise ValueError(f"latency_s row for batch {b} has {len(row)} values, expected "
                                 f"one per share ({len(self.shares)})")
            for v in row:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                    raise ValueError(f"latency for batch {b} must be finite seconds > 0, got {v!r}")

    @classmethod
    def from_points(cls, points: Iterable[tuple[int, float, float]]) -> "LatencyGrid":
        """The grid of (batch_size, share, latency_s) points; every batch size must have been
        measured at every share (ValueError naming the first missing cell)."""
        cells = {(b, float(s)): lat for b, s, lat in points}
        bs = tuple(sorted({b for b, _ in cells}))
        sh = tuple(sorted({s for _, s in cells}))
        missing = next(((b, s) for b in bs for s in sh if (b, s) not in cells), None)
        if missing is not None:
            raise ValueError(f"the encode grid has no point at batch {missing[0]}, share {missing[1]:g}: "
                             "every batch size needs every share")
        return cls(bs, sh, tuple(tuple(cells[b, s] for s in sh) for b in bs))

    def points(self) -> list[tuple[int, float, float]]:
        """(batch_size, share, latency_s) of every cell, batch-major."""
        return [(b, s, lat) for b, row in zip(self.batch_sizes, self.latency_s) for s, lat in zip(self.shares, row)]

    def latency(self, batch_size: int, share: float) -> float:
        return self.latency_s[self.batch_sizes.index(batch_size)][self.shares.index(share)]


def _check_batch_sizes(bs: Sequence[int]) -> None:
    if not bs:
        raise ValueError("batch_sizes must not be empty")
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bs):
        raise ValueError(f"batch_sizes must be ints >= 1, got {list(bs)}")
    if list(bs) != sorted(set(bs)):
        raise ValueError(f"batch_sizes must be strictly increasing, got {list(bs)}")


def _check_shares(shares: Sequence[float]) -> None:
    if not shares:
        raise ValueError("shares must not be empty")
    if any(isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s <= 1 for s in shares):
        raise ValueError(f"shares must be numbers in (0, 1], got {list(shares)}")
    if list(shares) != sorted(set(shares)):
        raise ValueError(f"shares must be strictly increasing, got {list(shares)}")
    if shares[-1] != 1.0:
        raise ValueError(f"shares must end with 1.0 (the exclusive baseline), got {list(shares)}")


def measure_grid(measure_fn: MeasureFn, batch_sizes: Sequence[int],
                 shares: Sequence[float] = DEFAULT_SHARES, *, repeats: int = 1) -> LatencyGrid:
    """Measure every (batch size, share) cell; a cell is the median of `repeats` calls."""
    bs, sh = tuple(sorted(set(batch_sizes))), tuple(float(s) for s in shares)
    _check_batch_sizes(bs)
    _check_shares(sh)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rows = tuple(tuple(float(statistics.median(measure_fn(b, s) for _ in range(repeats)))
                       for s in sh) for b in bs)
    return LatencyGrid(bs, sh, rows)


@dataclass(frozen=True)
class PartitionerConfig:
    policy: Policy = "dynamic"
    tolerance: NonNegFloat = 0.10           # e.g. 0.1: encode within 10% of its exclusive latency
    static_share: Annotated[float, Field(gt=0, lt=1)] = 0.5

    def __post_init__(self) -> None:
        check_fields(self)


def policy_levels(config: PartitionerConfig) -> tuple[float, ...]:
    """The encode shares a backend must realize for `config`'s policy."""
    if config.policy == "static":
        return (config.static_share,)
    if config.policy == "timeslice":
        return (1.0,)
    return DEFAULT_SHARES


class SMPartitioner:
    """Maps a micro-batch size to an `Allocation`; O(log n) per call, decisions precomputed.
    `grid` may be None for the baselines (static, timeslice): they read no latencies."""

    def __init__(self, grid: LatencyGrid | None, config: PartitionerConfig | None = None) -> None:
        self.grid = grid
        self.config = config or PartitionerConfig()
        if grid is None and self.config.policy == "dynamic":
            raise ValueError("the dynamic policy needs a LatencyGrid (measure_grid() or LatencyGrid.from_points)")
        rows = grid.latency_s if grid is not None else ((1.0,),)
        self._per_size = tuple(self._decide(row) for row in rows)

    @property
    def policy(self) -> str:
        return self.config.policy

    @property
    def levels(self) -> tuple[float, ...]:
        return self.grid.shares if self.grid is not None else policy_levels(self.config)

    def with_tolerance(self, tolerance: float) -> "SMPartitioner":
        """The same grid and policy at another tolerance (the online controller's)."""
        return SMPartitioner(self.grid, dataclasses.replace(self.config, tolerance=tolerance))

    def choose(self, batch_size: int) -> Allocation:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self.grid is None:
            return self._per_size[0]
        return self._per_size[self._nearest(batch_size)]

    def _decide(self, row: Sequence[float]) -> Allocation:
        c = self.config
        if c.policy == "timeslice":
            return TIMESLICE
        if c.policy == "static":
            return _allocation(c.static_share, self.levels)
        limit = (1.0 + c.tolerance) * row[-1]
        j = next(j for j, lat in enumerate(row) if lat <= limit)  # share 1.0 always qualifies
        return _allocation(self.grid.shares[j], self.grid.shares)

    def _nearest(self, b: int) -> int:
        """Index of the nearest profiled batch size (ties go to the larger one)."""
        bs = self.grid.batch_sizes
        i = bisect.bisect_left(bs, b)
        if i == len(bs):
            return i - 1
        if i == 0 or bs[i] == b:
            return i
        return i if bs[i] - b <= b - bs[i - 1] else i - 1


class FixedPartitioner:
    """For a backend whose split was fixed at launch: every batch gets `allocation`.
    `policy` names what runs ("static", "timeslice" or "fixed"); `note` says why."""

    grid = None

    def __init__(self, allocation: Allocation, policy: str, note: str = "") -> None:
        self.allocation, self.policy, self.note = allocation, policy, note

    @property
    def levels(self) -> tuple[float, ...]:
        return (self.allocation.encode_share,)

    def choose(self, batch_size: int) -> Allocation:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return self.allocation


def _allocation(encode: float, shares: Sequence[float]) -> Allocation:
    idx = shares.index(encode) if encode in shares else None
    return Allocation(encode, round(1.0 - encode, 9), idx)
