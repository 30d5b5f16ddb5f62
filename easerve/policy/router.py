"""Prefill routing after encode: local (co-located) or remote, at a target remote fraction s.

`DeficitRouter` is the paper's control: it sends a request remote exactly when that keeps the
remote count nearest to s x routed, so after every request
    |remote_count - s * routed| <= 1/2
at every prefix of the stream (the paper promises < 1). s = 0 never routes remote, s = 1
always does. `RandomRouter` is the seeded Bernoulli baseline, whose error grows like sqrt(n).
Pure policies: no clock, no I/O, not thread-safe (one per encode worker).
"""
from __future__ import annotations

import random
from typing import Literal, Protocol

Route = Literal["remote", "local"]


def _check_fraction(s: float) -> float:
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not (0.0 <= s <= 1.0):
        raise ValueError(f"remote fraction s must be a number in [0, 1], got {s!r}")
    return float(s)


class Router(Protocol):
    s: float
    routed: int
    remote_count: int

    def route(self) -> Route: ...


class _Counts:
    __slots__ = ("s", "routed", "remote_count")

    def __init__(self, s: float) -> None:
        self.s = _check_fraction(s)
        self.routed = 0
        self.remote_count = 0

    @property
    def local_count(self) -> int:
        return self.routed - self.remote_count

    @property
    def error(self) -> float:
        """remote_count - s * routed (the deficit router keeps it in [-1/2, 1/2])."""
        return self.remote_count - self.s * self.routed

    def _record(self, remote: bool) -> Route:
        self.routed += 1
        if remote:
            self.remote_count += 1
            return "remote"
        return "local"

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(s={self.s}, routed={self.routed}, "
                f"remote={self.remote_count})")


class DeficitRouter(_Counts):
    """Deterministic: remote iff s*(n+1) - remote_count >= 1/2 (ties go remote)."""

    __slots__ = ()

    def retarget(self, s: float) -> None:
        """Route at fraction `s` from now on (the online controller's s): the counts restart, so
        the deficit bound holds again over every prefix from this call."""
        self.s = _check_fraction(s)
        self.routed = self.remote_count = 0

    def route(self) -> Route:
        deficit = self.s * (self.routed + 1) - self.remote_count
        return self._record(deficit >= 0.5)


class RandomRouter(_Counts):
    """Baseline: remote with probability s, independently per request (seeded)."""

    __slots__ = ("_rng",)

    def __init__(self, s: float, seed: int | None = 0) -> None:
        super().__init__(s)
        self._rng = random.Random(seed)

    def route(self) -> Route:
        return self._record(self._rng.random() < self.s)


def max_prefix_error(routes: list[Route], s: float) -> float:
    """Largest |remote - s*n| over the prefixes of a routing sequence (for tests/benches)."""
    s = _check_fraction(s)
    remote, worst = 0, 0.0
    for n, r in enumerate(routes, start=1):
        remote += r == "remote"
        worst = max(worst, abs(remote - s * n))
    return worst
