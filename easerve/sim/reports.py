"""What a caller sees of one stage's instances: their load reports, as the live `Peers` does.

Live, a caller (the gateway; an encode instance for its remote prefills) polls each instance's
`Stage/Load` every `POLL_S` (easerve/policy/placement.py) and places by `LeastLoaded` over
`Candidate(reported at the last poll, sent by this caller since, capacity)` (`Peer.candidate`,
easerve/stages/common/peers.py). `Reports` keeps the same fields per instance (`Report`), is
polled on the simulated clock by `Poller`, and `pick()` places exactly as `Peers.pick` does.
With `exact=True` it places by each instance's exact `outstanding` count instead (the
simulator's earlier rule). An instance that drains (easerve/sim/online.py) is taken out of the
candidates at once, not at the next poll.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from easerve.policy.placement import POLL_S, Candidate, LeastLoaded
from easerve.sim.events import EventQueue


@dataclass
class Report:
    """One instance as its caller last saw it: the fields of the live `Peer` that placement and
    admission (easerve/policy/gateway_state.py `PeerLoad`) read."""
    key: str
    up: bool = True           # optimistic until the first poll, as live
    reported: int = 0         # requests it held at the last poll
    capacity: int = 0         # its --max-inflight (0 until the first poll: unknown)
    queued: int = 0           # waiting for compute at the last poll
    overdue: int = 0          # of those, put last by the deadline order
    kv_free_tokens: int = 0   # decode only
    sent_since_poll: int = 0
    polled_at: float = 0.0
    recent_batch_s: float = 0.0     # pace: not simulated (0: unknown, the predictor's scale is 1)
    recent_batch_size: float = 0.0

    def candidate(self) -> Candidate:
        return Candidate(self.key, self.up, self.reported, self.sent_since_poll, self.capacity)


def load_of(inst: Any, now: float) -> tuple[int, int, int, int]:
    """(queued, overdue, kv_free_tokens, capacity) as the instance's `Stage/Load` answers at `now`."""
    if hasattr(inst, "batching"):    # encode: its batcher's queue
        b = inst.batching
        return b.pending, min(b.batcher.overdue(now), b.pending), 0, inst.capacity
    if hasattr(inst, "planner"):     # prefill: its planner's queue
        p = inst.planner
        return p.pending, min(p.overdue(now), p.pending), 0, inst.capacity
    s = inst.sched                   # decode: the engine's admission queue and KV room
    return s.num_waiting, 0, s.blocks.free_tokens, s.max_running + s.max_waiting


class Reports:
    """One caller's view of one stage: `instances()` lists them now (the list may change)."""

    def __init__(self, instances: Callable[[], Sequence[Any]], exact: bool = False) -> None:
        self.instances, self.exact = instances, exact
        self.policy = LeastLoaded()
        self._reports: dict[int, Report] = {}   # id(instance) -> its report
        # in order, for tests: ("poll", time, ((reported, capacity), ...) per instance) and
        # ("pick", time, the candidates, the key chosen)
        self.log: list[tuple] = []

    def report(self, inst: Any) -> Report:
        r = self._reports.get(id(inst))
        if r is None:
            r = self._reports[id(inst)] = Report(getattr(inst, "name", str(id(inst))))
        return r

    def poll(self, now: float) -> None:
        """Every instance's load answer at `now` (the live poll: sent-since starts over)."""
        for inst in self.instances():
            r = self.report(inst)
            r.queued, r.overdue, r.kv_free_tokens, r.capacity = load_of(inst, now)
            r.reported, r.sent_since_poll, r.polled_at = inst.outstanding, 0, now
        self.log.append(("poll", now, tuple((self.report(i).reported, self.report(i).capacity)
                                            for i in self.instances())))

    def up_reports(self) -> list[Report]:
        """The instances that take work, as last seen (the live `Peers.up_peers`)."""
        return [self.report(i) for i in self.instances() if not getattr(i, "draining", False)]

    def pick(self, now: float = 0.0, exclude: frozenset[str] = frozenset()) -> Any:
        """The instance `LeastLoaded` chooses (None: none up); counted as sent to it."""
        insts = list(self.instances())
        cands = []
        for i, inst in enumerate(insts):
            up = not getattr(inst, "draining", False)
            if self.exact:
                cands.append(Candidate(str(i), up, inst.outstanding, 0, inst.capacity))
            else:
                r = self.report(inst)
                cands.append(Candidate(str(i), up, r.reported, r.sent_since_poll, r.capacity))
        key = self.policy.choose(cands, exclude)
        if key is None:
            return None
        self.log.append(("pick", now, tuple(cands), key))
        inst = insts[int(key)]
        self.report(inst).sent_since_poll += 1
        return inst


@dataclass
class Poller:
    """Polls every registered `Reports` each `period_s` from time 0 while `busy()` says requests
    are still open (then stops, so the event queue can empty)."""
    events: EventQueue
    busy: Callable[[], bool]
    period_s: float = POLL_S
    views: list[Reports] = field(default_factory=list)

    def start(self) -> None:
        self.events.at(self.events.now(), self._tick)

    def _tick(self) -> None:
        now = self.events.now()
        for v in self.views:
            v.poll(now)
        if self.busy():
            self.events.after(self.period_s, self._tick)
