"""Deadline order shared by the encode batcher and the prefill planner (SLO-aware admission).

A queued request may carry the time its first token is due by its SLO tier (`deadline`, on
the caller's clock) and whether it yields (admitted best-effort, or of the `batch` priority
class). Order: first the requests that can still meet their tier (they do not yield and their
deadline has not passed), earliest deadline first (no deadline: due last among them), ties in
arrival order; then every other request (yielding, or past its deadline) in arrival order.
So best-effort and batch work never goes ahead of a request that can still meet its tier, and
a request that yields is overtaken only by requests that can still meet theirs.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

Slo = tuple[float, bool]  # (deadline, yields); deadline math.inf: no tier


def can_meet(slo: Slo | None, now: float) -> bool:
    """True for a request that does not yield and whose deadline has not passed."""
    return slo is None or (not slo[1] and slo[0] >= now)


def overdue(slos: Iterable[Slo | None], now: float) -> int:
    """How many of `slos` the order puts last at `now` (they yield or are past their deadline)."""
    return sum(not can_meet(s, now) for s in slos)


def slo_order(slos: Sequence[Slo | None], now: float) -> list[int]:
    """Positions of `slos` (a queue in arrival order; None: no deadline, does not yield) in
    deadline order at `now`."""
    def key(pos: int) -> tuple[int, float, int]:
        s = slos[pos]
        if can_meet(s, now):
            return (0, math.inf if s is None else s[0], pos)
        return (1, 0.0, pos)
    return sorted(range(len(slos)), key=key)
