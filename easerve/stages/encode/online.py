"""`--online`: the online controller (easerve/policy/online.py) on the live encode worker.

Every `interval_s` it feeds the controller this worker's busy-seconds counters (encode and the
co-located prefill, from EncodeMetrics), its queue (requests in the batcher or its running
batch), both scaled to the encode stage by the instance count the launcher keeps in
`--online-instances-file` (placement spreads the load evenly) and, for remote prefill, the
increase of each instance's busy-seconds counter from its Load answers (`busy_s`; one that
does not report it counts as busy for an interval in which it held a request); arrivals come
from the servicer. Encode's busy seconds include the running batch's time so far. It applies
the plan to the live batcher (B), the deficit router (s) and the partitioner (tolerance), logs
each change with its reason and exports `easerve:online_changes_total{knob,reason}`,
`easerve:desired_instances{stage}` (encode, and prefill when it has remote instances) and
`easerve:online_knob{knob}`. Decode is not visible from here: no desired count is exported for it.
"""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from prometheus_client import Counter, Gauge

from easerve.policy.clock import Clock
from easerve.policy.online import Knobs, OnlineConfig, OnlineController, OnlinePlan, apply_knobs

log = logging.getLogger("easerve.encode")


class OnlineMetrics:
    def __init__(self, registry, stages: tuple[str, ...]) -> None:
        """`stages`: those whose desired count is exported (the ones this worker observes)."""
        self.stages = stages
        self.changes = Counter("easerve:online_changes", "Changes the online controller made, by knob and reason",
                               ["knob", "reason"], registry=registry)
        self.desired = Gauge("easerve:desired_instances", "Instances per stage the online controller asks for",
                             ["stage"], registry=registry)
        self.knob = Gauge("easerve:online_knob", "The knobs the online controller runs with", ["knob"],
                          registry=registry)

    def on_plan(self, plan: OnlinePlan) -> None:
        for c in plan.changes:
            self.changes.labels(knob=c.knob, reason=c.reason).inc()
        for stage, n in plan.desired:
            if stage in self.stages:
                self.desired.labels(stage=stage).set(n)
        for name, v in vars(plan.knobs).items():
            self.knob.labels(knob=name).set(v)


class OnlineTask:
    """Owns the controller; `arrival(modality)` from the servicer, `start()` / `stop()` on the loop."""

    def __init__(self, config: OnlineConfig, initial: Knobs, clock: Clock, *, batcher, router, partition,
                 metrics, remote, queued, registry, instances_file: str = "") -> None:
        """`partition`: the PartitionController (None without co-located prefill); `metrics`:
        EncodeMetrics (its busy_s counters); `remote`: the remote prefill Peers; `queued()`:
        requests held by the encode loop; `instances_file`: JSON {stage: instances} the launcher
        keeps (--online-instances-file; without it this instance counts as the whole stage)."""
        self.instances_file = instances_file
        self.clock, self.batcher, self.router, self.partition = clock, batcher, router, partition
        self.m, self.remote, self.queued = metrics, remote, queued
        self.ctl = OnlineController(initial, {"encode": 1, "prefill": max(1, len(remote)), "decode": 1}, config)
        self.metrics = OnlineMetrics(registry, ("encode", "prefill") if remote else ("encode",))
        self.metrics.on_plan(self.ctl.plan(clock.now()))
        self._remote_busy = 0.0
        self._busy_seen: dict[str, float] = {}  # remote prefill address -> its busy_s at the last step
        self._last = clock.now()
        self._task: asyncio.Task | None = None

    def arrival(self, modality: str) -> None:
        self.ctl.on_arrival(self.clock.now(), modality)

    def step(self) -> OnlinePlan:
        now = self.clock.now()
        busy = self.m.busy_s
        n = self._encode_instances()  # load is spread evenly (least-loaded placement): this one stands for each
        self.ctl.observe("encode", now, self.m.encode_busy_at(now) * n, n, self.queued() * n)
        if self.partition is not None:
            self.ctl.observe("local_prefill", now, busy["prefill"], 1)
        peers = [self.remote.get(a) for a in self.remote.addrs]
        if peers:
            self._remote_busy += self._remote_busy_since_last(peers, now - self._last)
            self.ctl.observe("prefill", now, self._remote_busy, len(peers),
                             sum(p.reported for p in peers if p is not None))
        self._last = now
        plan = self.ctl.plan(now)
        part = self.partition.partitioner if self.partition is not None else None
        new = apply_knobs(plan.knobs, self.batcher, self.router if self.partition is not None else None, part)
        if new is not part:
            self.partition.partitioner = new
        for c in plan.changes:
            log.info("online: %s %s -> %s (%s: %s)", c.knob, c.old, c.new, c.reason, c.detail)
        self.metrics.on_plan(plan)
        return plan

    def _remote_busy_since_last(self, peers, dt: float) -> float:
        """Compute seconds of the remote prefill instances since the last step (an instance
        first seen now adds none: its counter is the baseline)."""
        out, seen = 0.0, {}
        for p in peers:
            if p is None:
                continue
            if p.busy_s > 0:
                seen[p.addr] = p.busy_s
                last = self._busy_seen.get(p.addr)
                out += 0.0 if last is None else min(max(0.0, p.busy_s - last), dt)
            elif p.reported > 0:
                out += dt
        self._busy_seen = seen
        return out

    def _encode_instances(self) -> int:
        if not self.instances_file:
            return 1
        try:
            n = json.loads(Path(self.instances_file).read_text()).get("encode", 1)
        except (OSError, ValueError, AttributeError):
            return 1  # not written yet, or being replaced: one instance
        return n if isinstance(n, int) and n >= 1 else 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.ctl.config.interval_s)
            try:
                self.step()
            except Exception:  # noqa: BLE001 - the controller must never stop serving
                log.exception("online controller step failed")

