"""Every call the simulator makes into the encode batcher goes through `EncodeBatching`.

Today's live loop (easerve/stages/encode/loop.py) queues each dispatch the batcher decides
(at an arrival or when its gap / cap timer is due) and its one encode worker runs them in
order. The worker's busy / free transitions are explicit inputs here (`worker_busy`,
`worker_free`), so a work-conserving batcher that is told them adapts this one class.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Hashable

from easerve.policy.batcher import AdaptiveBatcher, BatcherConfig, Dispatch


class EncodeBatching:
    def __init__(self, config: BatcherConfig) -> None:
        self.batcher = AdaptiveBatcher(config)
        self._ready: deque[Dispatch] = deque()   # decided, waiting for the worker (encode_loop's queue)
        self.busy = False
        self.dispatches: list[Dispatch] = []     # every decision, in order (for tests and traces)

    def arrive(self, item_id: Hashable, now: float) -> None:
        self._push(self.batcher.add(item_id, now))

    def poll(self, now: float) -> None:
        """Take every dispatch due at `now` (the live timer task's loop)."""
        while True:
            d = self.batcher.poll(now)
            if d is None:
                return
            self._push(d)

    def next_deadline(self, now: float) -> float | None:
        return self.batcher.next_deadline(now)

    def remove(self, item_id: Hashable) -> bool:
        return self.batcher.remove(item_id)

    def worker_busy(self, now: float) -> None:
        self.busy = True

    def worker_free(self, now: float) -> None:
        self.busy = False

    def next_for_worker(self) -> Dispatch | None:
        """The next batch the free worker runs, or None."""
        return self._ready.popleft() if self._ready and not self.busy else None

    @property
    def pending(self) -> int:
        return self.batcher.pending + sum(d.size for d in self._ready)

    def _push(self, d: Dispatch | None) -> None:
        if d is not None:
            self._ready.append(d)
            self.dispatches.append(d)
