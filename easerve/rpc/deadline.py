"""Deadlines: one absolute monotonic value per request, passed on as `timeout=` downstream.

A request's deadline reaches a service two ways: the gRPC call's own deadline
(`context.time_remaining()`) and `RequestMeta.deadline_ms` (remaining ms when sent).
`Deadline.from_context` takes the earlier; `downstream_timeout` gives the `timeout=`
for the next hop, raising DeadlineExceeded when nothing is left.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from easerve.errors import DeadlineExceeded

Clock = Callable[[], float]
DEFAULT_FLOOR_S = 0.005


@dataclass(frozen=True)
class Deadline:
    """An absolute point on `time.monotonic()`; `math.inf` means none."""

    at: float

    def __post_init__(self) -> None:
        if math.isnan(self.at):
            raise ValueError("Deadline.at must be a monotonic time or math.inf, got nan")

    @classmethod
    def none(cls) -> "Deadline":
        return cls(math.inf)

    @classmethod
    def after(cls, seconds: float | None, clock: Clock = time.monotonic) -> "Deadline":
        return cls.none() if seconds is None else cls(clock() + seconds)

    @classmethod
    def from_ms(cls, remaining_ms: int, clock: Clock = time.monotonic) -> "Deadline":
        """From RequestMeta.deadline_ms (0 = no deadline)."""
        return cls.none() if remaining_ms <= 0 else cls.after(remaining_ms / 1000, clock)

    @classmethod
    def from_context(cls, context, deadline_ms: int = 0, clock: Clock = time.monotonic) -> "Deadline":
        """The earlier of the call's gRPC deadline and a RequestMeta.deadline_ms."""
        return cls.after(remaining_from_context(context), clock).earliest(cls.from_ms(deadline_ms, clock))

    @property
    def bounded(self) -> bool:
        return self.at != math.inf

    def earliest(self, other: "Deadline") -> "Deadline":
        return self if self.at <= other.at else other

    def remaining(self, clock: Clock = time.monotonic) -> float:
        """Seconds left (may be <= 0); math.inf without a deadline."""
        return self.at - clock() if self.bounded else math.inf

    def expired(self, clock: Clock = time.monotonic) -> bool:
        return self.remaining(clock) <= 0

    def check(self, what: str = "request", clock: Clock = time.monotonic) -> None:
        if self.expired(clock):
            raise DeadlineExceeded(f"deadline of {what} exceeded")

    def timeout(self, floor_s: float = DEFAULT_FLOOR_S, clock: Clock = time.monotonic) -> float | None:
        """`timeout=` for a downstream call: None without a deadline, at least floor_s;
        DeadlineExceeded if it has already passed."""
        left = self.remaining(clock)
        if left == math.inf:
            return None
        if left <= 0:
            raise DeadlineExceeded(f"deadline passed {-left * 1000:.1f} ms ago")
        return max(left, floor_s)

    def to_ms(self, clock: Clock = time.monotonic) -> int:
        """For RequestMeta.deadline_ms: remaining ms, at least 1; 0 without a deadline."""
        left = self.remaining(clock)
        return 0 if left == math.inf else max(1, math.ceil(left * 1000))


def remaining_from_context(context) -> float | None:
    """Seconds left on a grpc.aio call (None when the client set no deadline)."""
    left = context.time_remaining()
    return None if left is None or left > 1e9 else float(left)


def downstream_timeout(context, deadline_ms: int = 0, *, floor_s: float = DEFAULT_FLOOR_S) -> float | None:
    """`timeout=` for the next hop of the call served by `context`."""
    return Deadline.from_context(context, deadline_ms).timeout(floor_s)
