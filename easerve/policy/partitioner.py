"""Per-micro-batch compute partitioning between encode and co-located prefill.

At start-up `profile()` measures encode latency over batch sizes x share levels through an
injected `measure_fn(batch_size, share) -> seconds` (a GPU timing in the service, a formula in
tests and the simulator). `SMPartitioner.choose(batch_size)` then returns, per batch, the
`Allocation` that the backend in `sm_backends` realizes:

- "dynamic":   the smallest share whose latency <= (1 + tolerance) x exclusive (share 1.0)
               latency; prefill gets the rest (0 at share 1.0: prefill then only time-slices)
- "static":    always `static_share` (0.5: the paper's static 50/50 baseline); the backend is
               built with that one level (`policy_levels`), so it realizes the split itself
               rather than the nearest profiled level
- "timeslice": no partition; both sides may use the whole device (uncontrolled baseline)

The two baselines need no profile (`SMPartitioner(None, config)`). `FixedPartitioner` is for a
backend whose split is fixed at launch (MPS, the static backend): it has nothing to choose.

Pure: no torch, no I/O (`to_json`/`from_json` work on strings; the caller stores them).
"""
from __future__ import annotations

import bisect
import json
import math
import statistics
from dataclasses import dataclass
from typing import Annotated, Callable, Literal, Sequence, get_args

from pydantic import Field

from easerve.fields import NonNegFloat, check_fields

DEFAULT_SHARES: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8, 1.0)
FORMAT = "easerve.sm_profile"
VERSION = 1

Policy = Literal["dynamic", "static", "timeslice"]  # --partition-policy
POLICIES: tuple[str, ...] = get_args(Policy)
MeasureFn = Callable[[int, float], float]


@dataclass(frozen=True)
class Allocation:
    """Compute shares for the next micro-batch. `level_index` indexes the profile's shares
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
class ProfileTable:
    """latency_s[i][j]: encode latency at batch_sizes[i] and shares[j] (seconds)."""

    batch_sizes: tuple[int, ...]
    shares: tuple[float, ...]
    latency_s: tuple[tuple[float, ...], ...]
    device: str = ""

    def __post_init__(self) -> None:
        _check_batch_sizes(self.batch_sizes)
        _check_shares(self.shares)
        if len(self.latency_s) != len(self.batch_sizes):
            raise ValueError(f"latency_s has {len(self.latency_s)} rows, expected one per batch "
                             f"size ({len(self.batch_sizes)}); re-run the profile")
        for b, row in zip(self.batch_sizes, self.latency_s):
            if len(row) != len(self.shares):
                raise ValueError(f"latency_s row for batch {b} has {len(row)} values, expected "
                                 f"one per share ({len(self.shares)}); re-run the profile")
            for v in row:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                    raise ValueError(f"latency for batch {b} must be finite seconds > 0, got {v!r}")

    def latency(self, batch_size: int, share: float) -> float:
        return self.latency_s[self.batch_sizes.index(batch_size)][self.shares.index(share)]

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "version": VERSION, "device": self.device,
                           "batch_sizes": list(self.batch_sizes), "shares": list(self.shares),
                           "latency_s": [list(r) for r in self.latency_s]},
                          allow_nan=False, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ProfileTable":
        """Parse and validate a saved profile; ValueError says what is wrong."""
        try:
            d = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"SM profile is not valid JSON ({e}); re-run the profile") from e
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not an SM profile: expected an object with format={FORMAT!r}")
        if d.get("version") != VERSION:
            raise ValueError(f"SM profile version {d.get('version')!r} is not supported "
                             f"(expected {VERSION}); re-run the profile")
        missing = [k for k in ("batch_sizes", "shares", "latency_s") if not isinstance(d.get(k), list)]
        if missing:
            raise ValueError(f"SM profile lacks list field(s) {missing}; re-run the profile")
        if not all(isinstance(r, list) for r in d["latency_s"]):
            raise ValueError("SM profile latency_s must be a list of lists (one row per batch size)")
        return cls(tuple(d["batch_sizes"]), tuple(d["shares"]),
                   tuple(tuple(r) for r in d["latency_s"]), str(d.get("device", "")))


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


def profile(measure_fn: MeasureFn, batch_sizes: Sequence[int],
            shares: Sequence[float] = DEFAULT_SHARES, *, repeats: int = 1,
            device: str = "") -> ProfileTable:
    """Measure every (batch size, share) cell; a cell is the median of `repeats` calls."""
    bs, sh = tuple(sorted(set(batch_sizes))), tuple(float(s) for s in shares)
    _check_batch_sizes(bs)
    _check_shares(sh)
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rows = tuple(tuple(float(statistics.median(measure_fn(b, s) for _ in range(repeats)))
                       for s in sh) for b in bs)
    return ProfileTable(bs, sh, rows, device)


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
    `table` may be None for the baselines (static, timeslice): they read no latencies."""

    def __init__(self, table: ProfileTable | None, config: PartitionerConfig | None = None) -> None:
        self.table = table
        self.config = config or PartitionerConfig()
        if table is None and self.config.policy == "dynamic":
            raise ValueError("the dynamic policy needs a profile table (profile() or ProfileTable.from_json)")
        rows = table.latency_s if table is not None else ((1.0,),)
        self._per_size = tuple(self._decide(row) for row in rows)

    @property
    def policy(self) -> str:
        return self.config.policy

    @property
    def levels(self) -> tuple[float, ...]:
        return self.table.shares if self.table is not None else policy_levels(self.config)

    def choose(self, batch_size: int) -> Allocation:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if self.table is None:
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
        return _allocation(self.table.shares[j], self.table.shares)

    def _nearest(self, b: int) -> int:
        """Index of the nearest profiled batch size (ties go to the larger one)."""
        bs = self.table.batch_sizes
        i = bisect.bisect_left(bs, b)
        if i == len(bs):
            return i - 1
        if i == 0 or bs[i] == b:
            return i
        return i if bs[i] - b <= b - bs[i - 1] else i - 1


class FixedPartitioner:
    """For a backend whose split was fixed at launch: every batch gets `allocation`.
    `policy` names what runs ("static", "timeslice" or "fixed"); `note` says why."""

    table = None

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
