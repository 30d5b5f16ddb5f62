"""Injected clocks: the control plane never reads time itself.

The services pass a `MonotonicClock` to the loops that read time (the encode loop, the
prefill loop) and those hand its `now` to the policies; tests pass a `ManualClock` and
move it by hand, so the same policy code runs in both.
"""
from __future__ import annotations

import math
import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (the origin is arbitrary)."""
        ...


class MonotonicClock:
    """Wall-independent process clock (`time.monotonic`)."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that only moves when told to (tests, discrete-event simulation)."""

    __slots__ = ("_t",)

    def __init__(self, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"start must be a finite number of seconds, got {start}")
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def advance(self, dt: float) -> float:
        """Move forward by `dt` seconds; returns the new time."""
        if not dt >= 0 or not math.isfinite(dt):
            raise ValueError(f"advance() needs a finite dt >= 0 seconds, got {dt}")
        self._t += dt
        return self._t

    def advance_to(self, t: float) -> float:
        """Jump to absolute time `t` (never backwards); returns it."""
        if not t >= self._t or not math.isfinite(t):
            raise ValueError(f"advance_to() needs a finite t >= now ({self._t}), got {t}")
        self._t = float(t)
        return self._t
