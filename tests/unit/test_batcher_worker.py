"""AdaptiveBatcher in front of a simulated worker: the work-conserving properties.

A small pure event loop (ManualClock) plays arrivals against one worker whose batch of k
costs `cost(k)` seconds. Whatever the batcher hands out while the worker is busy waits in
a FIFO in front of it, as it did in the push-based encode loop; the work-conserving batcher
never puts anything there.
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Callable

from hypothesis import given, settings, strategies as st

from easerve.policy.batcher import AdaptiveBatcher, BatcherConfig, Dispatch
from easerve.policy.clock import ManualClock


@dataclass(frozen=True)
class Run:
    starts: tuple[tuple[float, Dispatch], ...]  # (when the worker started it, the batch), in order
    arrived: tuple[float, ...]                  # arrival time of item i
    queued_behind: int                          # most dispatches ever waiting for the busy worker

    @property
    def mean_batch(self) -> float:
        return len(self.arrived) / len(self.starts)


def simulate(cfg: BatcherConfig, arrivals: list[float], cost: Callable[[int], float]) -> Run:
    b, clock = AdaptiveBatcher(cfg), ManualClock()
    waiting: deque[Dispatch] = deque()
    starts: list[tuple[float, Dispatch]] = []
    free_at, i, most = None, 0, 0
    for _ in range(20 * len(arrivals) + 10):
        now = clock.now()
        nxt = arrivals[i] if i < len(arrivals) else math.inf
        dl = b.next_deadline(now)
        fin = math.inf if free_at is None else free_at
        t = min(nxt, fin, math.inf if dl is None else max(dl, now))
        if t == math.inf:
            break
        clock.advance_to(t)
        if fin == t:
            free_at = None
            b.on_free(t)
        if nxt == t:
            if (d := b.add(i, t)) is not None:
                waiting.append(d)
            i += 1
        while (d := b.poll(t)) is not None:
            waiting.append(d)
        most = max(most, len(waiting))
        if free_at is None and waiting:
            d = waiting.popleft()
            starts.append((t, d))
            free_at = t + cost(d.size)
    assert i == len(arrivals) and b.pending == 0 and not waiting and free_at is None
    return Run(tuple(starts), tuple(arrivals), most)


def unit_trace(n: int, seed: int) -> list[float]:
    """A rate-1 Poisson trace; divide by a rate to replay it at that rate."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0)
        out.append(t)
    return out


def linear_cost(fixed_s: float, per_item_s: float) -> Callable[[int], float]:
    return lambda k: fixed_s + per_item_s * k


BATCHING = ["adaptive", "fixed", "continuous"]
cfg_st = st.builds(BatcherConfig, max_batch=st.integers(1, 16), safety_cap_s=st.floats(0.05, 2.0),
                   gap_coef=st.floats(0.5, 4.0), mode=st.sampled_from([*BATCHING, "request_at_a_time"]),
                   max_gap_s=st.none() | st.floats(0.002, 0.5))
cost_st = st.builds(linear_cost, st.floats(0.01, 0.5), st.floats(0.0, 0.1))


@settings(max_examples=150, deadline=None)
@given(cfg=cfg_st, cost=cost_st, rate=st.floats(0.5, 200.0), seed=st.integers(0, 2**16),
       n=st.integers(1, 150))
def test_no_request_waits_behind_a_batch_that_left_with_room(cfg, cost, rate, seed, n) -> None:
    run = simulate(cfg, [u / rate for u in unit_trace(n, seed)], cost)
    room = 1 if cfg.mode == "request_at_a_time" else cfg.max_batch
    batch_of = {item: k for k, (_, d) in enumerate(run.starts) for item in d.item_ids}
    for k, (started, d) in enumerate(run.starts):
        assert all(a <= started for a in (run.arrived[j] for j in d.item_ids))
        if d.size < room:  # room left: everything that had arrived is in it or went before
            behind = [j for j, a in enumerate(run.arrived) if a < started and batch_of[j] > k]
            assert not behind, f"batch {k} of {d.size} started at {started:.4f} with room; {behind} waited"
    assert run.queued_behind <= 1  # a dispatch is started the moment it is handed out


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(BATCHING), max_batch=st.integers(2, 16), fixed_s=st.floats(0.02, 0.3),
       per_item_s=st.floats(0.0, 0.03), seed=st.integers(0, 2**16),
       rates=st.lists(st.floats(0.5, 100.0), min_size=2, max_size=4, unique=True))
def test_batches_never_shrink_as_the_rate_rises(mode, max_batch, fixed_s, per_item_s, seed, rates) -> None:
    cfg = BatcherConfig(max_batch=max_batch, mode=mode, safety_cap_s=1.0, max_gap_s=0.05)
    unit, cost = unit_trace(400, seed), linear_cost(fixed_s, per_item_s)
    means = [simulate(cfg, [u / r for u in unit], cost).mean_batch for r in sorted(rates)]
    for lo, hi in zip(means, means[1:]):
        assert hi >= lo * 0.95, f"mean batch fell from {lo:.2f} to {hi:.2f} as the rate rose ({sorted(rates)})"


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(BATCHING), max_batch=st.integers(2, 16), fixed_s=st.floats(0.05, 1.0),
       per_item_s=st.floats(0.0, 0.02), load=st.floats(2.0, 40.0), seed=st.integers(0, 2**16))
def test_a_busy_worker_gets_batches_as_full_as_its_cost_allows(mode, max_batch, fixed_s, per_item_s, load,
                                                               seed) -> None:
    """Arrivals come `load` times faster than a batch of one costs: while it runs, about
    min(B, load) requests arrive, and they must leave together when it frees."""
    rate = load / (fixed_s + per_item_s)
    per_batch = min(max_batch, load)
    if per_item_s * rate >= 0.9:  # the worker cannot keep up even at batch B: fine, batches are then full
        per_batch = max_batch
    cfg = BatcherConfig(max_batch=max_batch, mode=mode, safety_cap_s=1.0, max_gap_s=0.05)
    run = simulate(cfg, [u / rate for u in unit_trace(300, seed)], linear_cost(fixed_s, per_item_s))
    assert run.mean_batch > 1.0
    assert run.mean_batch >= 0.7 * per_batch, f"mean batch {run.mean_batch:.2f}, a busy worker allows {per_batch:.1f}"
