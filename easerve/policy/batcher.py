"""Adaptive encode micro-batcher (paper section "Batch according to the arrival process").

Pure policy: no clock reads, no I/O, no torch. The caller passes `now` (from an injected
`Clock`) to every call and executes the `Dispatch` plans it gets back.

Work-conserving: the batcher batches for ONE worker and knows whether it is busy. Handing
out a `Dispatch` marks the worker busy; the caller says `on_free(now)` when that batch has
finished. While the worker is busy nothing is dispatched and arrivals accumulate; once it is
free, whatever is due leaves as one batch of up to `max_batch`, oldest first, so no batch
ever waits in a queue behind a running one (a dispatch decided by the clock alone and
queued behind a busy worker turns into batches of one under load). A caller modelling an
always-free worker calls `on_free(now)` right after each dispatch.

With the worker free, a batch is dispatched when
- it reaches `max_batch`                                               -> reason "size"
- the time since the last arrival reaches the gap threshold (adaptive) -> reason "gap"
- its oldest request has waited `safety_cap_s` (adaptive, fixed)       -> reason "cap"
Modes: `adaptive` (size, gap, cap); `fixed` (size and cap only); `request_at_a_time` (the
Dynamo-like baseline: the oldest request alone as soon as the worker is free, "single");
`continuous` (no timer at all: a free worker takes whatever is pending at once, "idle").
An item that waited past the cap while the worker was busy leaves the moment it frees.

Deadline order (SLO-aware admission): an item may carry the time its first token is due by
its SLO tier (`deadline`) and whether it yields (`yields`: admitted best-effort, or of the
`batch` priority class). When more items are due than a batch holds, the batch takes them in
`easerve.policy.slo_order` order: first the items that can still meet their tier (no yield,
deadline not passed), earliest deadline first (an item without a deadline counts as due last
among them), then the rest in arrival order; so best-effort and batch work never takes the
place of an item that can still meet its tier. The timers (gap, cap) still look at arrivals only.

Rate estimate: an EWMA of inter-arrival gaps, weighted per arrival with a half-life of
RATE_HALFLIFE arrivals; lambda = 1 / EWMA(gap) and the threshold is
`gap_coef * EWMA(gap) = gap_coef / lambda`, clamped to [MIN_GAP_S, max_gap_s]. A gap sample
longer than `max_gap_s / gap_coef` is truncated to it: the threshold could not use the extra
length, and truncation lets the estimate recover within a few arrivals after an idle period.
So `rate` never reads below `gap_coef / max_gap_s`.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Literal, get_args

from easerve.fields import PosFloat, PosInt, check_fields
from easerve.policy.slo_order import overdue, slo_order

BatchMode = Literal["adaptive", "fixed", "request_at_a_time", "continuous"]  # --batch-mode
MODES: tuple[str, ...] = get_args(BatchMode)
DispatchReason = Literal["size", "gap", "cap", "single", "idle", "flush"]
RATE_HALFLIFE = 16.0  # arrivals: the rate estimate's EWMA half-life
MIN_GAP_S = 0.001     # the gap threshold's floor (a 0 threshold would split simultaneous arrivals)


def batch_limit(mode: str, max_batch: int | None) -> int | None:
    """The largest batch `mode` ever runs: 1 for request_at_a_time, else `max_batch`
    (None: no limit given)."""
    if mode not in MODES:
        raise ValueError(f"batch mode must be one of {MODES}, got {mode!r}")
    return 1 if mode == "request_at_a_time" else max_batch


@dataclass(frozen=True)
class BatcherConfig:
    """Knobs of one encode worker's batcher (each one an encode flag). The gap threshold is
    gap_coef / lambda clamped to [MIN_GAP_S, max_gap_s]; `max_gap_s=None` means
    `safety_cap_s`. Until two arrivals have been seen the threshold is max_gap_s."""

    max_batch: PosInt = 8
    safety_cap_s: PosFloat = 1.0
    gap_coef: PosFloat = 2.0
    mode: BatchMode = "adaptive"
    max_gap_s: PosFloat | None = None

    def __post_init__(self) -> None:
        check_fields(self)
        if self.gap_ceiling_s < MIN_GAP_S:
            raise ValueError(
                f"max_gap_s ({self.gap_ceiling_s}) must be >= {MIN_GAP_S} s, the gap threshold's floor; "
                "raise max_gap_s (or safety_cap_s when max_gap_s is unset)")

    @property
    def gap_ceiling_s(self) -> float:
        return self.safety_cap_s if self.max_gap_s is None else self.max_gap_s

    @property
    def alpha(self) -> float:
        """EWMA weight of one new gap sample."""
        return 1.0 - 0.5 ** (1.0 / RATE_HALFLIFE)


@dataclass(frozen=True)
class Dispatch:
    """A plan: encode these items now, as one batch."""

    item_ids: tuple[Hashable, ...]
    reason: DispatchReason
    at: float            # the `now` the decision was made at
    oldest_wait_s: float  # how long the oldest item had waited

    @property
    def size(self) -> int:
        return len(self.item_ids)


class AdaptiveBatcher:
    """Per-worker batcher. Not thread-safe: call it from the worker's event loop.

        d = b.add(item_id, now)     # a Dispatch only while the worker is free
        d = b.poll(now)             # the batch due at `now`, if the worker is free
        b.next_deadline(now)        # when to poll next (None: wait for an arrival or on_free)
        b.on_free(now)              # the dispatched batch finished: poll at once
    Every Dispatch returned marks the worker busy until `on_free`."""

    def __init__(self, config: BatcherConfig | None = None) -> None:
        self.config = config or BatcherConfig()
        c = self.config
        self._alpha = c.alpha
        self._sample_cap = c.gap_ceiling_s / c.gap_coef
        self._ewma_gap: float | None = None
        self._queue: deque[tuple[Hashable, float]] = deque()
        self._slo: dict[Hashable, tuple[float, bool]] = {}  # item -> (deadline, yields), when given
        self._last_arrival: float | None = None
        self._last_now = -math.inf
        self._threshold = self._compute_threshold()
        self._busy = False
        self.dispatched = 0  # batches handed out so far

    # ---- read-only state -------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self._queue)

    def overdue(self, now: float) -> int:
        """Pending items the deadline order puts last at `now` (they yield or are past their
        deadline): an item that can still meet its tier waits only behind the others."""
        return overdue((self._slo.get(iid) for iid, _ in self._queue), now)

    @property
    def busy(self) -> bool:
        """True from a handed-out Dispatch until `on_free`."""
        return self._busy

    @property
    def rate(self) -> float | None:
        """Estimated arrivals per second (None before two arrivals)."""
        if self._ewma_gap is None:
            return None
        return math.inf if self._ewma_gap == 0 else 1.0 / self._ewma_gap

    @property
    def gap_threshold(self) -> float:
        """Seconds of silence after the last arrival that close a partial batch."""
        return self._threshold

    def _compute_threshold(self) -> float:
        c = self.config
        if self._ewma_gap is None:
            return c.gap_ceiling_s
        return min(c.gap_ceiling_s, max(MIN_GAP_S, c.gap_coef * self._ewma_gap))

    # ---- decisions ---------------------------------------------------------------------
    def add(self, item_id: Hashable, now: float, deadline: float | None = None,
            yields: bool = False) -> Dispatch | None:
        """Enqueue one arrival. With the worker free, returns a dispatch if one is due at
        `now`: a full batch, the item alone (request_at_a_time), all that is pending
        (continuous), or a batch whose gap/cap timer had already expired before this arrival
        (the caller polled late; the new item joins it). With the worker busy, None.
        `deadline` / `yields`: see "Deadline order" above."""
        self._tick(now)
        expired = self._due(now)  # before this arrival restarts the gap timer
        self._observe_arrival(now)
        self._queue.append((item_id, now))
        if deadline is not None or yields:
            self._slo[item_id] = (math.inf if deadline is None else deadline, yields)
        reason = self._due(now) or expired
        return None if reason is None else self._take(reason, now)

    def poll(self, now: float) -> Dispatch | None:
        """The batch due at `now`, if any (None while the worker is busy)."""
        self._tick(now)
        reason = self._due(now)
        return None if reason is None else self._take(reason, now)

    def on_free(self, now: float) -> None:
        """The worker finished the batch last dispatched: `poll(now)` hands out what is due."""
        self._tick(now)
        if not self._busy:
            raise RuntimeError("on_free() without a dispatched batch: call it once per Dispatch, "
                               "when the worker has finished that batch")
        self._busy = False

    def next_deadline(self, now: float) -> float | None:
        """Absolute time at which `poll` next has something to do (<= now: poll at once);
        None while nothing is pending or the worker is busy (on_free ends that)."""
        q = self._queue
        if not q or self._busy:
            return None
        mode = self.config.mode
        if mode in ("request_at_a_time", "continuous") or len(q) >= self.config.max_batch:
            return now
        cap_at = q[0][1] + self.config.safety_cap_s
        if mode != "adaptive":
            return cap_at
        return min(cap_at, self._last_arrival + self._threshold)

    def flush(self, now: float) -> Dispatch | None:
        """Dispatch up to max_batch pending items regardless of timers and of the worker
        (drain on shutdown)."""
        self._tick(now)
        return self._take("flush", now) if self._queue else None

    def reconfigure(self, config: BatcherConfig) -> None:
        """Run with new knobs from now on (the online controller's B): what is pending, the rate
        estimate and the busy worker stay; the gap threshold is recomputed under the new config."""
        self.config = config
        self._alpha = config.alpha
        self._sample_cap = config.gap_ceiling_s / config.gap_coef
        self._threshold = self._compute_threshold()

    def remove(self, item_id: Hashable) -> bool:
        """Drop a pending item (client cancelled). True if it was pending."""
        for i, (iid, _) in enumerate(self._queue):
            if iid == item_id:
                del self._queue[i]
                self._slo.pop(item_id, None)
                return True
        return False

    # ---- internals ---------------------------------------------------------------------
    def _due(self, now: float) -> DispatchReason | None:
        q, c = self._queue, self.config
        if not q or self._busy:
            return None
        if c.mode == "request_at_a_time":
            return "single"
        if len(q) >= c.max_batch:
            return "size"
        if c.mode == "continuous":
            return "idle"
        if now >= q[0][1] + c.safety_cap_s:
            return "cap"
        if c.mode == "adaptive" and now >= self._last_arrival + self._threshold:
            return "gap"
        return None

    def _take(self, reason: DispatchReason, now: float) -> Dispatch:
        n = 1 if reason == "single" else min(len(self._queue), self.config.max_batch)
        oldest = self._queue[0][1]
        if self._slo:
            ids = self._by_deadline(n, now)
        else:
            ids = tuple(self._queue.popleft()[0] for _ in range(n))
        for i in ids:
            self._slo.pop(i, None)
        self.dispatched += 1
        self._busy = True
        return Dispatch(ids, reason, now, now - oldest)

    def _by_deadline(self, n: int, now: float) -> tuple[Hashable, ...]:
        """The `n` items to take when more are pending: those that can still meet their tier
        by deadline (then arrival), then the others by arrival; the rest stay queued in order."""
        order = slo_order([self._slo.get(iid) for iid, _ in self._queue], now)[:n]
        ids = tuple(self._queue[p][0] for p in order)
        take = set(order)
        self._queue = deque(e for p, e in enumerate(self._queue) if p not in take)
        return ids

    def _observe_arrival(self, now: float) -> None:
        if self._last_arrival is not None:
            gap = min(now - self._last_arrival, self._sample_cap)
            e = self._ewma_gap
            self._ewma_gap = gap if e is None else e + self._alpha * (gap - e)
            self._threshold = self._compute_threshold()
        self._last_arrival = now

    def _tick(self, now: float) -> None:
        if not now >= self._last_now:  # also rejects NaN
            raise ValueError(f"now must not go backwards: got {now} after {self._last_now}; "
                             "pass times from one monotonic Clock")
        self._last_now = now
