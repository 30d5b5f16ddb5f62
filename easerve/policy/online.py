"""Online controller: re-tunes the encode knobs and sizes each stage as the load moves.

Pure policy (no clock reads, no I/O): the caller feeds observations with the `now` of an
injected clock and applies the `OnlinePlan` that `plan(now)` returns, as a vLLM scheduler's
output is applied by its engine.

Observations, over a sliding window of `window_s`:
- `on_arrival(now, modality)`: the arrival rate and the media mix;
- `observe(stage, now, busy_s, instances, queued)`: a stage's cumulative busy seconds (a
  counter, summed over its instances), its instance count and its queue depth; utilization is
  the counter's increase over the window / (window x instances), queue growth the depth's
  change per second. Stages: encode, prefill (remote), decode, and local_prefill (the prefill
  co-located on the encode device; only its utilization is read).

Decisions (each knob within `OnlineBounds`, each change a `Change` with a reason code for
metrics and a sentence with the figures behind it):
- `max_batch` (B): doubles when encode utilization >= `high_util` (larger batches raise the
  encoder's throughput), halves when <= `low_util` (less batching delay);
- `remote_fraction` (s, co-located deployments): steps towards the less busy side, the remote
  prefill vs the encode device (encode + local prefill), when they differ by `balance_margin`;
- `tolerance` (the partitioner's): steps down when encode is the bottleneck (encode gets more
  of its device), up when the local prefill is busy and encode is not;
- desired instances per stage (encode, prefill, decode): n x utilization / `target_util`
  rounded up, one more when the queue grows at high utilization; up only at >= `high_util` or
  a growing queue, down only at <= `low_util` and when n - 1 instances stay under the target.
No oscillation: the thresholds leave a dead band between them; a knob (or a stage's desired
count) changes at most once per `dwell_s`, and a change against the direction of its last
change waits `reversal_dwell_s` after it, except that a desired count may grow again one
`dwell_s` after it shrank (capacity is not withheld; a shrink after a growth still waits). So a
knob changes at most 3600 / dwell_s times an hour and a count shrinks at most 3600 /
reversal_dwell_s times.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import Literal, get_args

from easerve.fields import Fraction, NonNegFloat, PosFloat, PosInt, check_fields
from easerve.policy.partitioner import SMPartitioner

Stage = Literal["encode", "prefill", "decode"]
STAGES: tuple[str, ...] = get_args(Stage)
OBSERVED = (*STAGES, "local_prefill")
Knob = Literal["max_batch", "remote_fraction", "tolerance", "instances_encode", "instances_prefill",
               "instances_decode"]
Reason = Literal["encode_busy", "encode_idle", "remote_busy", "local_busy", "stage_busy", "queue_growing",
                 "stage_idle"]


@dataclass(frozen=True)
class OnlineBounds:
    """What the controller may move, and how far (the encode flags --online-batch, ...)."""
    min_batch: PosInt = 1
    max_batch: PosInt = 32
    min_remote_fraction: Fraction = 0.0
    max_remote_fraction: Fraction = 1.0
    min_tolerance: NonNegFloat = 0.0
    max_tolerance: NonNegFloat = 0.5
    min_instances: PosInt = 1
    max_instances: PosInt = 1

    def __post_init__(self) -> None:
        check_fields(self)
        for lo, hi in (("min_batch", "max_batch"), ("min_remote_fraction", "max_remote_fraction"),
                       ("min_tolerance", "max_tolerance"), ("min_instances", "max_instances")):
            if getattr(self, lo) > getattr(self, hi):
                raise ValueError(f"{lo} ({getattr(self, lo)}) must be <= {hi} ({getattr(self, hi)}); "
                                 f"lower {lo} or raise {hi}")


@dataclass(frozen=True)
class OnlineConfig:
    bounds: OnlineBounds = OnlineBounds()
    window_s: PosFloat = 20.0         # sliding window of every estimate
    interval_s: PosFloat = 2.0        # plan() decides at most this often
    dwell_s: PosFloat = 30.0          # at least this long between two changes of one knob
    reversal_dwell_s: PosFloat = 120.0  # ... and this long before a change against the last one
    high_util: Fraction = 0.85
    low_util: Fraction = 0.4
    target_util: Fraction = 0.7
    balance_margin: Fraction = 0.2
    remote_step: Fraction = 0.1
    tolerance_step: NonNegFloat = 0.05
    colocated: bool = False           # s and the tolerance mean something only with co-located prefill

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.low_util < self.target_util < self.high_util:
            raise ValueError(f"need low_util < target_util < high_util, got {self.low_util}, {self.target_util}, "
                             f"{self.high_util}: the gap between low and high is the hysteresis band")
        if self.reversal_dwell_s < self.dwell_s:
            raise ValueError(f"reversal_dwell_s ({self.reversal_dwell_s}) must be >= dwell_s ({self.dwell_s})")


@dataclass(frozen=True)
class Knobs:
    max_batch: int
    remote_fraction: float
    tolerance: float


@dataclass(frozen=True)
class Change:
    at: float
    knob: Knob
    old: float
    new: float
    reason: Reason   # a short code (a metric label)
    detail: str      # the figures behind it, for the log


@dataclass(frozen=True)
class Estimates:
    rate: float                                  # arrivals per second over the window
    mix: tuple[tuple[str, float], ...]           # (modality, share of the arrivals)
    utilization: tuple[tuple[str, float], ...]   # (stage, busy fraction per instance)
    queue_growth: tuple[tuple[str, float], ...]  # (stage, queued requests per second)

    def util(self, stage: str) -> float:
        return dict(self.utilization).get(stage, 0.0)

    def growth(self, stage: str) -> float:
        return dict(self.queue_growth).get(stage, 0.0)


@dataclass(frozen=True)
class OnlinePlan:
    at: float
    knobs: Knobs
    desired: tuple[tuple[str, int], ...]   # (stage, instances wanted)
    changes: tuple[Change, ...]
    estimates: Estimates | None            # None until a full window has been seen

    def desired_of(self, stage: str) -> int:
        return dict(self.desired)[stage]


class OnlineController:
    """Not thread-safe: call it from one loop. `plan(now)` returns the knobs to run with."""

    def __init__(self, initial: Knobs, instances: dict[str, int] | None = None,
                 config: OnlineConfig | None = None) -> None:
        self.config = c = config or OnlineConfig()
        b = c.bounds
        self.knobs = Knobs(min(max(initial.max_batch, b.min_batch), b.max_batch),
                           min(max(initial.remote_fraction, b.min_remote_fraction), b.max_remote_fraction),
                           min(max(initial.tolerance, b.min_tolerance), b.max_tolerance))
        given = instances or {}
        self.desired = {s: min(max(given.get(s, 1), b.min_instances), b.max_instances) for s in STAGES}
        self._arrivals: deque[tuple[float, str]] = deque()
        self._samples: dict[str, deque[tuple[float, float, int, int]]] = {s: deque() for s in OBSERVED}
        self._last: dict[str, tuple[float, int]] = {}  # knob -> (time, direction) of its last change
        self._start: float | None = None
        self._planned = -math.inf
        self._now = -math.inf
        self.changes: list[Change] = []

    # ---- observations ------------------------------------------------------------------------
    def on_arrival(self, now: float, modality: str) -> None:
        self._tick(now)
        self._arrivals.append((now, modality))

    def observe(self, stage: str, now: float, busy_s: float, instances: int, queued: int = 0) -> None:
        if stage not in OBSERVED:
            raise ValueError(f"stage must be one of {OBSERVED}, got {stage!r}")
        self._tick(now)
        self._samples[stage].append((now, float(busy_s), max(0, int(instances)), int(queued)))

    # ---- decisions ---------------------------------------------------------------------------
    def estimates(self, now: float) -> Estimates | None:
        """The window's estimates; None until a full window has passed since the first observation."""
        self._tick(now)
        self._prune(now)
        if self._start is None or now - self._start < self.config.window_s:
            return None
        span = self.config.window_s
        counts: dict[str, int] = {}
        for _, m in self._arrivals:
            counts[m] = counts.get(m, 0) + 1
        n = len(self._arrivals)
        util, growth = [], []
        for stage, ss in self._samples.items():
            if len(ss) < 2:
                continue
            (t0, b0, _, q0), (t1, b1, _, q1) = ss[0], ss[-1]
            inst = max(1.0, sum(s[2] for s in ss) / len(ss))
            if t1 > t0:
                util.append((stage, max(0.0, (b1 - b0) / ((t1 - t0) * inst))))
                growth.append((stage, (q1 - q0) / (t1 - t0)))
        return Estimates(n / span, tuple(sorted((m, k / n) for m, k in counts.items())), tuple(util), tuple(growth))

    def plan(self, now: float) -> OnlinePlan:
        """The knobs and instance counts to run with from `now`, and the changes made now (none
        before a full window, or sooner than `interval_s` after the last decision)."""
        est = self.estimates(now)
        changes: list[Change] = []
        if est is not None and now - self._planned >= self.config.interval_s:
            self._planned = now
            changes = self._decide(now, est)
            self.changes.extend(changes)
        return OnlinePlan(now, self.knobs, tuple((s, self.desired[s]) for s in STAGES), tuple(changes), est)

    def _decide(self, now: float, est: Estimates) -> list[Change]:
        c, b, k = self.config, self.config.bounds, self.knobs
        out: list[Change] = []
        ue = est.util("encode")
        if ue >= c.high_util and k.max_batch < b.max_batch:
            self._move(out, now, "max_batch", k.max_batch, min(b.max_batch, k.max_batch * 2), "encode_busy",
                       f"encode utilization {ue:.2f} >= {c.high_util}: larger batches raise its throughput")
        elif ue <= c.low_util and k.max_batch > b.min_batch:
            self._move(out, now, "max_batch", k.max_batch, max(b.min_batch, k.max_batch // 2), "encode_idle",
                       f"encode utilization {ue:.2f} <= {c.low_util}: smaller batches cut the batching delay")
        if c.colocated:
            self._balance(out, now, est)
        for stage in STAGES:
            self._size(out, now, stage, est)
        return out

    def _balance(self, out: list[Change], now: float, est: Estimates) -> None:
        c, b, k = self.config, self.config.bounds, self.knobs
        ue, ul, ur = est.util("encode"), est.util("local_prefill"), est.util("prefill")
        device = min(1.0, ue + ul)
        if ur - device >= c.balance_margin and k.remote_fraction > b.min_remote_fraction:
            self._move(out, now, "remote_fraction", k.remote_fraction,
                       round(max(b.min_remote_fraction, k.remote_fraction - c.remote_step), 6), "remote_busy",
                       f"remote prefill utilization {ur:.2f} exceeds the encode device's {device:.2f}: "
                       "more prefill stays local")
        elif device - ur >= c.balance_margin and k.remote_fraction < b.max_remote_fraction:
            self._move(out, now, "remote_fraction", k.remote_fraction,
                       round(min(b.max_remote_fraction, k.remote_fraction + c.remote_step), 6), "local_busy",
                       f"the encode device's utilization {device:.2f} exceeds remote prefill's {ur:.2f}: "
                       "more prefill goes remote")
        if ue >= c.high_util and k.tolerance > b.min_tolerance:
            self._move(out, now, "tolerance", k.tolerance, round(max(b.min_tolerance, k.tolerance - c.tolerance_step), 6),
                       "encode_busy", f"encode utilization {ue:.2f} >= {c.high_util}: encode keeps more of its device")
        elif ul >= c.high_util and ue <= c.low_util and k.tolerance < b.max_tolerance:
            self._move(out, now, "tolerance", k.tolerance, round(min(b.max_tolerance, k.tolerance + c.tolerance_step), 6),
                       "local_busy", f"local prefill utilization {ul:.2f} >= {c.high_util} while encode's is "
                       f"{ue:.2f}: prefill gets more of the device")

    def _size(self, out: list[Change], now: float, stage: str, est: Estimates) -> None:
        c, b = self.config, self.config.bounds
        ss = self._samples[stage]
        if len(ss) < 2:
            return
        n = max(1, ss[-1][2])
        u, g = est.util(stage), est.growth(stage)
        want = math.ceil(n * min(u, 1.0) / c.target_util - 1e-9)
        cur = self.desired[stage]
        if g > 0 and u >= c.high_util:
            want, reason = max(want, n + 1), "queue_growing"
            detail = f"{stage} queue grows {g:.2f}/s at utilization {u:.2f}"
        elif u >= c.high_util:
            reason, detail = "stage_busy", f"{stage} utilization {u:.2f} >= {c.high_util} on {n} instance(s)"
        elif u <= c.low_util and n > 1 and n * u / (n - 1) <= c.target_util:
            reason, detail = "stage_idle", f"{stage} utilization {u:.2f} <= {c.low_util} on {n} instance(s)"
        else:
            return
        want = min(max(want, b.min_instances), b.max_instances)
        if want != cur:
            self._move(out, now, f"instances_{stage}", cur, want, reason, f"{detail}: {want} wanted")

    def _move(self, out: list[Change], now: float, knob: str, old, new, reason: str, detail: str) -> None:
        if new == old:
            return
        direction = 1 if new > old else -1
        last = self._last.get(knob)
        if last is not None:
            # capacity comes back after one dwell; only taking it away again waits out the reversal
            reversal = last[1] != direction and not (knob.startswith("instances_") and direction > 0)
            wait = self.config.reversal_dwell_s if reversal else self.config.dwell_s
            if now - last[0] < wait:
                return
        self._last[knob] = (now, direction)
        if knob.startswith("instances_"):
            self.desired[knob.removeprefix("instances_")] = int(new)
        else:
            self.knobs = Knobs(**{**vars(self.knobs), knob: new})
        out.append(Change(now, knob, old, new, reason, detail))  # type: ignore[arg-type]

    # ---- internals ---------------------------------------------------------------------------
    def _prune(self, now: float) -> None:
        edge = now - self.config.window_s
        while self._arrivals and self._arrivals[0][0] < edge:
            self._arrivals.popleft()
        for ss in self._samples.values():
            while len(ss) > 2 and ss[1][0] <= edge:  # keep one sample at or before the edge
                ss.popleft()

    def _tick(self, now: float) -> None:
        if not now >= self._now:
            raise ValueError(f"now must not go backwards: got {now} after {self._now}; pass times from one Clock")
        self._now = now
        if self._start is None:
            self._start = now


def apply_knobs(knobs: Knobs, batcher, router, partitioner):
    """Put `knobs` into one encode worker's live policies; returns the partitioner to use next
    (a new one when a dynamic partitioner's tolerance moved, else the one given)."""
    if batcher.config.max_batch != knobs.max_batch and batcher.config.mode != "request_at_a_time":
        batcher.reconfigure(dataclasses.replace(batcher.config, max_batch=knobs.max_batch))
    if router is not None and router.s != knobs.remote_fraction:
        router.retarget(knobs.remote_fraction)
    if isinstance(partitioner, SMPartitioner) and partitioner.policy == "dynamic" \
            and partitioner.config.tolerance != knobs.tolerance:
        return partitioner.with_tolerance(knobs.tolerance)
    return partitioner
