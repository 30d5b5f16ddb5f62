"""Prefill batch planner: which queued requests go into the next prefill forward.

Pure policy: no clock reads, no I/O, no torch. The caller passes `now` (from an injected
`Clock`) and executes the `PrefillBatchPlan`s it gets back.

Rule (first come, first served, like vLLM's `max_num_batched_tokens` for prefill):
take requests from the head of the queue, in arrival order, while the batch stays within
`max_batch_size` requests and `max_batched_tokens` prompt tokens in total (prefill packs
the prompts end to end, so the sum is what one forward computes). The first request that
does not fit ends the batch: nothing behind it jumps ahead. A request larger than the
whole budget runs alone when it reaches the head (`oversized`), so it is never starved.

Deadline order (SLO-aware admission): a request may carry the time its first token is due
by its SLO tier (`deadline`) and whether it yields (`yields`: admitted best-effort, or of the
`batch` priority class). The "queue" the rule above walks is then in `easerve.policy.slo_order`
order at `now`: the requests that can still meet their tier (no yield, deadline not passed)
earliest deadline first, then the others (yielding, or past their deadline) in arrival order.
So a request that yields is planned only once no request that can still meet its tier is
waiting, and is overtaken only by such requests. Without deadlines or yields the order is
the arrival order.

Work-conserving, like the encode batcher (`easerve.policy.batcher`): a plan handed out
marks the worker busy until `on_free(now)`; meanwhile `next_batch` returns None and
arrivals accumulate, and once it is free the next batch is whatever is queued (within
the budget), at once: no timer, the encode batcher's `continuous` mode.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Iterable

from easerve.policy.slo_order import Slo, overdue, slo_order


@dataclass(frozen=True)
class PrefillBatchConfig:
    """`max_batched_tokens`: prompt tokens one batched forward may hold (vLLM's
    max_num_batched_tokens); `max_batch_size`: requests per forward."""

    max_batched_tokens: int = 2048
    max_batch_size: int = 16

    def __post_init__(self) -> None:
        for name in ("max_batched_tokens", "max_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}; set it to a positive count "
                                 "(1 for max_batch_size prefills one request per forward)")


@dataclass(frozen=True)
class PrefillBatchPlan:
    """Prefill these requests now, in this order, as one forward."""

    request_ids: tuple[Hashable, ...]
    num_tokens: tuple[int, ...]
    at: float              # the `now` the decision was made at
    oldest_wait_s: float   # how long the oldest request of the batch had waited

    @property
    def size(self) -> int:
        return len(self.request_ids)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def oversized(self, config: PrefillBatchConfig) -> bool:
        """A lone request above the token budget (allowed so that it is never starved)."""
        return self.total_tokens > config.max_batched_tokens


def take_fcfs(num_tokens: Iterable[int], config: PrefillBatchConfig) -> int:
    """How many requests from the head of a queue (their prompt token counts, in arrival
    order) form the next batch: >= 1 for a non-empty queue, 0 for an empty one."""
    total = taken = 0
    for tokens in num_tokens:
        if taken == config.max_batch_size or (taken and total + tokens > config.max_batched_tokens):
            break
        total += tokens
        taken += 1
    return taken


class PrefillBatcher:
    """Queue of one prefill worker (FCFS, or deadline order for requests that carry a
    deadline or yield). Not thread-safe: call it from the worker's event loop."""

    def __init__(self, config: PrefillBatchConfig | None = None) -> None:
        self.config = config or PrefillBatchConfig()
        self._queue: deque[tuple[Hashable, int, float]] = deque()
        self._ids: set[Hashable] = set()
        self._slo: dict[Hashable, Slo] = {}  # request -> (deadline, yields), when given
        self._last_now = float("-inf")
        self._busy = False

    @property
    def pending(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        """True from a handed-out plan until `on_free`."""
        return self._busy

    @property
    def pending_tokens(self) -> int:
        return sum(n for _, n, _ in self._queue)

    def overdue(self, now: float) -> int:
        """Queued requests the deadline order puts last at `now` (they yield or are past their
        deadline): a request that can still meet its tier waits only behind the others."""
        return overdue((self._slo.get(rid) for rid, _, _ in self._queue), now)

    def add(self, request_id: Hashable, num_tokens: int, now: float, deadline: float | None = None,
            yields: bool = False) -> None:
        """Queue one request of `num_tokens` prompt tokens; `deadline` (on the clock of `now`)
        and `yields`: see "Deadline order" above."""
        self._tick(now)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"request {request_id!r}: num_tokens must be an int >= 1, got {num_tokens!r}; "
                             "send a prompt of at least one token")
        if request_id in self._ids:
            raise ValueError(f"request {request_id!r} is already queued; give every request its own id")
        if deadline is not None and not deadline == deadline:
            raise ValueError(f"request {request_id!r}: deadline is NaN; pass a time on the clock of `now` or None")
        self._queue.append((request_id, num_tokens, now))
        self._ids.add(request_id)
        if deadline is not None or yields:
            self._slo[request_id] = (math.inf if deadline is None else deadline, yields)

    def remove(self, request_id: Hashable) -> bool:
        """Drop a queued request (cancelled). True if it was queued."""
        if request_id not in self._ids:
            return False
        self._ids.discard(request_id)
        self._slo.pop(request_id, None)
        self._queue = deque(e for e in self._queue if e[0] != request_id)
        return True

    def next_batch(self, now: float) -> PrefillBatchPlan | None:
        """Take the next batch off the queue (None while it is empty or the worker is busy)."""
        self._tick(now)
        if self._busy:
            return None
        q = self._queue
        order = slo_order([self._slo.get(rid) for rid, _, _ in q], now) if self._slo else range(len(q))
        n = take_fcfs((q[p][1] for p in order), self.config)
        if n == 0:
            return None
        if self._slo:
            taken = [q[p] for p in order[:n]]
            picked = set(order[:n])
            self._queue = deque(e for p, e in enumerate(q) if p not in picked)
        else:
            taken = [q.popleft() for _ in range(n)]
        for rid, _, _ in taken:
            self._ids.discard(rid)
            self._slo.pop(rid, None)
        self._busy = True
        return PrefillBatchPlan(tuple(rid for rid, _, _ in taken), tuple(t for _, t, _ in taken), now,
                                now - min(t for _, _, t in taken))

    def on_free(self, now: float) -> None:
        """The worker finished the batch last handed out: `next_batch` gives the next one."""
        self._tick(now)
        if not self._busy:
            raise RuntimeError("on_free() without a planned batch: call it once per plan, "
                               "when the worker has finished that batch")
        self._busy = False

    def _tick(self, now: float) -> None:
        if not now >= self._last_now:  # also rejects NaN
            raise ValueError(f"now must not go backwards: got {now} after {self._last_now}; "
                             "pass times from one monotonic Clock")
        self._last_now = now
