"""Every call the simulator makes into the encode batcher goes through `EncodeBatching`.

As in the live loop (easerve/stages/encode/loop.py), the batcher is work-conserving: a
`Dispatch` it hands out marks its one worker busy until `worker_free`, so there is at most one
decided batch waiting for the worker, and arrivals during a batch accumulate in the batcher.
"""
from __future__ import annotations

from collections.abc import Hashable

from easerve.policy.batcher import AdaptiveBatcher, BatcherConfig, Dispatch


class EncodeBatching:
    def __init__(self, config: BatcherConfig) -> None:
        self.batcher = AdaptiveBatcher(config)
        self._ready: Dispatch | None = None     # handed out, not yet taken by the worker
        self.dispatches: list[Dispatch] = []     # every decision, in order (for tests and traces)
        self.arrivals: list[tuple[Hashable, float, float | None, bool]] = []  # (item, time, deadline, yields)

    def arrive(self, item_id: Hashable, now: float, deadline: float | None = None, yields: bool = False) -> None:
        """An item queues; `deadline` / `yields`: its place in the batcher's deadline order."""
        self.arrivals.append((item_id, now, deadline, yields))
        self._take(self.batcher.add(item_id, now, deadline, yields))

    def poll(self, now: float) -> None:
        """The batch due at `now`, if the worker is free (the live worker's wake-up)."""
        self._take(self.batcher.poll(now))

    def next_deadline(self, now: float) -> float | None:
        return self.batcher.next_deadline(now)

    def remove(self, item_id: Hashable) -> bool:
        return self.batcher.remove(item_id)

    def worker_free(self, now: float) -> None:
        """The dispatched batch ended (or had nothing left to run): whatever is due leaves now."""
        self.batcher.on_free(now)
        self.poll(now)

    def next_for_worker(self) -> Dispatch | None:
        """The batch the worker runs next, or None."""
        d, self._ready = self._ready, None
        return d

    @property
    def ready(self) -> bool:
        """A decided batch waits for the worker."""
        return self._ready is not None

    @property
    def pending(self) -> int:
        return self.batcher.pending + (self._ready.size if self._ready is not None else 0)

    def _take(self, d: Dispatch | None) -> None:
        if d is not None:
            self._ready = d
            self.dispatches.append(d)
