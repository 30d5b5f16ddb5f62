"""Bounded admission for a stage: at most `limit` requests in flight; past that the
request is refused at once with Overloaded (RESOURCE_EXHAUSTED / 429) instead of
queueing without bound until memory runs out."""
from __future__ import annotations

from contextlib import contextmanager

from easerve.errors import Overloaded


class InflightLimit:
    def __init__(self, limit: int, what: str):
        if limit < 1:
            raise ValueError(f"the {what} in-flight limit must be >= 1, got {limit}")
        self.limit, self.what, self.inflight = limit, what, 0

    @contextmanager
    def admit(self):
        if self.inflight >= self.limit:
            raise Overloaded(f"{self.what} is at its limit of {self.limit} requests in flight; retry later")
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1
