"""Which instance of the next stage gets a request: the least outstanding work.

Pure and torch-free. Each candidate's load is what its last `Stage/Load` answer (polled every
`POLL_S`) said it holds plus what this caller has sent it since (so a burst between two polls spreads
instead of piling on the instance that looked idlest); instances that are down or not
serving are not candidates. Ties go round robin, so equal instances share evenly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

POLL_S = 0.25  # how often a caller asks each instance for its load (easerve/stages/common/peers.py)


@dataclass(frozen=True)
class Candidate:
    key: str              # the instance's address
    up: bool              # reachable and SERVING at the last look
    reported: int = 0     # requests it held at its last Load answer
    sent_since: int = 0   # requests this caller started on it since that answer
    capacity: int = 0     # most it takes (0 = unknown)

    @property
    def load(self) -> int:
        return self.reported + self.sent_since

    @property
    def full(self) -> bool:
        return self.capacity > 0 and self.load >= self.capacity


class LeastLoaded:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate], exclude: frozenset[str] = frozenset()) -> str | None:
        """The key to use, or None when no instance is up. Full instances are chosen only
        when every instance that is up is full (they refuse; that is their answer to give)."""
        up = [c for c in candidates if c.up and c.key not in exclude]
        if not up:
            return None
        room = [c for c in up if not c.full] or up
        least = min(c.load for c in room)
        tied = [c for c in room if c.load == least]
        self._turn += 1
        return tied[self._turn % len(tied)].key
