"""The event queue: callbacks at simulated times, on an injected `ManualClock`.

Events at the same time run in the order they were scheduled (a sequence number breaks
ties), so a run is a pure function of its inputs.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

from easerve.policy.clock import ManualClock


class EventQueue:
    def __init__(self, clock: ManualClock | None = None) -> None:
        self.clock = clock or ManualClock()
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0
        self.processed = 0

    def now(self) -> float:
        return self.clock.now()

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` at absolute time `t` (not before now)."""
        if not t >= self.clock.now() or not math.isfinite(t):
            raise ValueError(f"cannot schedule an event at {t}: the clock is at {self.clock.now()}")
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.clock.now() + dt, fn, *args)

    def run(self, until: float = math.inf) -> None:
        """Process events in time order until none is left or the next is past `until`."""
        heap, clock = self._heap, self.clock
        while heap and heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(heap)
            if t > clock.now():
                clock.advance_to(t)
            fn(*args)
            self.processed += 1

    def __len__(self) -> int:
        return len(self._heap)
