"""The online controller (easerve/policy/online.py) inside the simulator.

`OnlineDriver` feeds the live `OnlineController` what the encode service would (arrivals,
each stage's busy-seconds counter, instance count and requests held; for decode, which steps
whenever it holds a request, the busy counter integrates how full its running batch is), every `interval_s` of
simulated time applies its plan to every encode instance (B to the batcher, s to the deficit
router, the tolerance to a dynamic partitioner) and, with `autoscale`, adds instances of a stage
on fresh devices or drains them (a draining instance gets no new work and finishes what it
holds) until each stage runs the desired count. GPU-seconds held are integrated over the run.
"""
from __future__ import annotations

import dataclasses

from easerve.policy.online import STAGES, Change, Knobs, OnlineConfig, OnlineController, apply_knobs
from easerve.sim.run import Sim
from easerve.sim.stages import DecodeInstance, EncodeInstance, PrefillWorker
from easerve.sim.workload import Req

FRESH_DEVICE_BASE = 64  # devices the autoscaler adds: cuda:64 and up (the simulator's ModelConfig says which
# node holds them: with devices_per_host >= 64 + instances added, the deployment's node)


def decode_saturation(sched) -> float:
    """How full a decode scheduler is: its running batch or its KV blocks, whichever is fuller."""
    b = sched.blocks
    return max(sched.num_running / sched.max_running, b.reserved_tokens / max(1, b.capacity_tokens))


class OnlineDriver:
    def __init__(self, config: OnlineConfig, *, autoscale: bool = False, budget: int | None = None) -> None:
        """`autoscale`: follow the desired counts on fresh devices; `budget`: instead, hold at
        most this many instances in all (the deployment's devices): a stage that wants more
        when the budget is spent takes one from the least utilized stage that can spare one."""
        self.config, self.autoscale, self.budget = config, autoscale or budget is not None, budget
        self.actions: list[tuple[float, str, str, str]] = []  # (time, stage, "add" | "drain", instance)
        self.ctl: OnlineController | None = None
        self.sim: Sim | None = None
        self.total = 0
        self.gpu_seconds = 0.0
        self._last_t = 0.0
        self._decode_busy = 0.0
        self._moved: dict[str, float] = {}  # stage -> when the budget last moved an instance to or from it

    @property
    def changes(self) -> list[Change]:
        return [] if self.ctl is None else self.ctl.changes

    def start(self, sim: Sim, reqs: list[Req]) -> None:
        self.sim, self.total = sim, len(reqs)
        first = sim.encode[0].cfg if sim.encode else None
        knobs = Knobs(first.batcher.max_batch if first else 1, first.remote_fraction if first else 1.0,
                      first.partitioner.tolerance if first else 0.1)
        colocated = any(e.local is not None for e in sim.encode)
        self.ctl = OnlineController(knobs, {s: len(self._active(s)) for s in STAGES},
                                    dataclasses.replace(self.config, colocated=colocated))
        for r in reqs:
            sim.events.at(r.spec.arrival_s, self._arrival, r.spec.modality)
        sim.events.at(0.0, self._tick)

    def _arrival(self, modality: str) -> None:
        self.ctl.on_arrival(self.sim.events.now(), modality)

    def _active(self, stage: str) -> list:
        sim = self.sim
        pool = {"encode": sim.encode, "prefill": sim.remote_prefills, "decode": sim.decode}[stage]
        return [i for i in pool if not getattr(i, "draining", False)]

    def _tick(self) -> None:
        sim, ctl = self.sim, self.ctl
        now = sim.events.now()
        dt, self._last_t = now - self._last_t, now
        self.gpu_seconds += self._held() * dt
        # decode steps whenever it holds anything: its saturation is how full its batch or its KV is
        # (reservations made at the gateway wait there for their KV: they are not decode's load)
        self._decode_busy += dt * sum(decode_saturation(i.sched) for i in sim.decode)
        for stage, pool in (("encode", sim.encode), ("prefill", sim.remote_prefills), ("decode", sim.decode)):
            if pool:
                busy = self._decode_busy if stage == "decode" else sum(i.compute.busy_s for i in pool)
                queued = sum(i.sched.num_waiting for i in pool) if stage == "decode" else \
                    sum(i.outstanding for i in pool)
                ctl.observe(stage, now, busy, len(self._active(stage)), queued)
        locals_ = [e.local for e in sim.encode if e.local is not None]
        if locals_:
            ctl.observe("local_prefill", now, sum(p.compute.busy_s for p in locals_), len(locals_))
        plan = ctl.plan(now)
        for e in sim.encode:
            e.partitioner = apply_knobs(plan.knobs, e.batching.batcher, e.router, e.partitioner)
        if self.budget is not None and plan.estimates is not None:
            self._rebalance(plan)
        elif self.autoscale:
            for stage in STAGES:
                self._scale(stage, plan.desired_of(stage))
        if len(sim.outcomes) < self.total:
            sim.events.after(self.config.interval_s, self._tick)

    def _scale(self, stage: str, want: int) -> None:
        active = self._active(stage)
        if not active:
            return  # a stage the deployment does not run (e.g. no remote prefill): nothing to size
        while len(active) < want:
            active.append(self._add(stage, active[0]))
        for inst in active[want:]:
            self._drain(stage, inst)

    def _rebalance(self, plan) -> None:
        """Within the budget (devices held anyway): grow the stages that want more, the busiest
        first, while the budget lasts; once it is spent move one instance from the least utilized
        stage that has more than one and wants no more. Nothing is drained only for being idle."""
        est, now = plan.estimates, self.sim.events.now()
        run = [s for s in STAGES if self._active(s)]
        for s in sorted(run, key=lambda s: -est.util(s)):
            active = self._active(s)
            if len(active) >= plan.desired_of(s):
                continue
            if self._held() < self.budget:
                self._add(s, active[0])
                continue
            donors = [d for d in run if d != s and len(self._active(d)) > 1
                      and len(self._active(d)) >= plan.desired_of(d) and est.util(d) < est.util(s)]
            last = self._moved.get(s, -1e9)
            if donors and now - last >= self.config.dwell_s:
                d = min(donors, key=est.util)
                self._drain(d, self._active(d)[-1])
                self._add(s, active[0])
                self._moved[s] = self._moved[d] = now

    def _held(self) -> int:
        return sum(len(self._active(s)) for s in STAGES) + len(self.sim.monolith)

    def _drain(self, stage: str, inst) -> None:
        inst.draining = True
        self.actions.append((self.sim.events.now(), stage, "drain", inst.name))

    def _add(self, stage: str, like):
        inst = self._new(stage, like)
        self.actions.append((self.sim.events.now(), stage, "add", inst.name))
        return inst

    def _new(self, stage: str, like):
        sim = self.sim
        for inst in {"encode": sim.encode, "prefill": sim.remote_prefills, "decode": sim.decode}[stage]:
            if getattr(inst, "draining", False):  # take a draining one back before a fresh device
                inst.draining = False
                return inst
        used = [int(c.device[5:]) for c in sim._computes if c.device.startswith("cuda:")]
        device = f"cuda:{max(used + [FRESH_DEVICE_BASE - 1]) + 1}"
        cfg = dataclasses.replace(like.cfg, device=device)
        if stage == "encode":
            inst = EncodeInstance(sim, cfg, f"encode-{len(sim.encode)}")
            inst.router.retarget(self.ctl.knobs.remote_fraction)
            sim.encode.append(inst)
            sim.encoders.append(inst)
            computes = [inst.compute] + ([inst.local.compute] if inst.local else [])
        elif stage == "prefill":
            inst = PrefillWorker(sim, cfg, device, f"prefill-{len(sim.remote_prefills)}")
            sim.remote_prefills.append(inst)
            sim.text_prefills.append(inst)
            computes = [inst.compute]
        else:
            inst = DecodeInstance(sim, cfg, f"decode-{len(sim.decode)}")
            sim.decode.append(inst)
            sim.decoders.append(inst)
            computes = [inst.compute]
        if len(computes) == 2:  # encode and its co-located prefill share the fresh device
            computes[0].neighbours, computes[1].neighbours = [computes[1]], [computes[0]]
        sim.add_computes(computes)
        sim.add_host(inst.hostw.compute)
        return inst
