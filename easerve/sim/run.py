"""Build the instances of a `Topology`, replay `SimRequest`s through them, collect what a
client would have seen (per-request records in the fields of `hasctl bench`'s records) and
each encode instance's utilization trace (the encode service's `/trace` format)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from easerve.sim import phases
from easerve.sim.compute import SerialGroup
from easerve.sim.events import EventQueue
from easerve.sim.reports import Poller
from easerve.policy.service_model import ModelConfig, ServiceModel, shares_compute
from easerve.sim.stages import DecodeInstance, EncodeInstance, Gateway, PrefillWorker
from easerve.sim.topology import Topology
from easerve.sim.workload import Req, SimRequest

GATEWAY_DEVICE = "cpu"


@dataclass
class SimResult:
    records: list[dict]
    traces: dict[str, dict]              # encode instance -> {"now", "buckets", "spans"} as GET /trace
    sim_seconds: float
    wall_seconds: float
    events: int
    dispatches: dict[str, list] = field(default_factory=dict)   # encode instance -> its batcher's Dispatches
    routes: dict[str, list[str]] = field(default_factory=dict)  # encode instance -> routes in order
    admissions: dict[str, list[tuple[str, ...]]] = field(default_factory=dict)  # decode -> admitted per step
    busy_s: dict[str, float] = field(default_factory=dict)      # worker -> seconds busy
    decisions: list = field(default_factory=list)  # the gateway admission's (easerve/sim/admission.py Decided)
    phases_ms: dict[str, float] = field(default_factory=dict)  # phase -> mean ms per request (easerve/sim/phases.py)

    @property
    def speed(self) -> float:
        """Simulated seconds per wall second."""
        return self.sim_seconds / max(self.wall_seconds, 1e-9)


class Sim:
    def __init__(self, topology: Topology, profile: Any, model_config: ModelConfig | None = None,
                 profiles: Sequence[Any] = (), online=None, exact_placement: bool = False,
                 service_model: ServiceModel | None = None) -> None:
        """`profiles`: for instances of another tensor-parallel degree; `online`: an
        easerve.sim.online.OnlineDriver that re-tunes (and sizes) the deployment as it runs;
        `exact_placement`: place by each instance's exact count, not its load reports
        (easerve/sim/reports.py); `service_model`: the service times to use instead of
        ServiceModel(profile, model_config, profiles) (a replay's measured ones:
        bench/fidelity_replay.py MeasuredModel)."""
        self.topology, self.profile, self.exact_placement = topology, profile, exact_placement
        self.model = service_model or ServiceModel(profile, model_config or ModelConfig(), profiles)
        for stage in ("encode", "prefill", "decode", "monolith"):
            for i, c in enumerate(getattr(topology, stage)):
                self.model.check_group(c.device, topology.tp_of(stage, i), f"{stage}-{i}")
        tp = topology.tp_of
        self.events = EventQueue()
        self.open = 0   # requests not ended yet: the load polls run while there are some
        self.poller = Poller(self.events, lambda: self.open > 0)
        self.gateway_device = GATEWAY_DEVICE
        self.gateway = Gateway(self, topology.gateway)
        self.encode = [EncodeInstance(self, c, f"encode-{i}", tp("encode", i)) for i, c in enumerate(topology.encode)]
        serial = self.model.config.monolith == "serial"
        self.monolith = [EncodeInstance(self, c, f"monolith-{i}", tp("monolith", i), SerialGroup() if serial else None,
                                        stage="monolith") for i, c in enumerate(topology.monolith)]
        self.remote_prefills = [PrefillWorker(self, c, c.device, f"prefill-{i}", tp=tp("prefill", i))
                                for i, c in enumerate(topology.prefill)]
        self.decode = [DecodeInstance(self, c, f"decode-{i}", tp("decode", i)) for i, c in enumerate(topology.decode)]
        self.mono_decode = [DecodeInstance(self, c, f"monolith-{i}/decode", tp("monolith", i), host=m)
                            for i, (c, m) in enumerate(zip(topology.monolith, self.monolith))]
        self.encoders = self.encode + self.monolith
        self.text_prefills = self.remote_prefills + [m.local for m in self.monolith]
        self.decoders = self.decode + self.mono_decode
        computes = ([e.compute for e in self.encoders] + [e.local.compute for e in self.encoders if e.local]
                    + [p.compute for p in self.remote_prefills] + [d.compute for d in self.decoders])
        computes += list({id(h): h.compute for h in [self.gateway.hostw, *self.gateway.threads] + [x.hostw for x in
                          self.encoders + self.remote_prefills + self.decoders]}.values())
        for c in computes:
            c.neighbours = [o for o in computes if o is not c and shares_compute(c.device, o.device, c.tp, o.tp)]
        for c in computes:
            c.wire_env()
        self._computes = computes
        self.outcomes: list[Req] = []
        self.online = online

    def add_computes(self, computes: list) -> None:
        """Workers of an instance added while running (their neighbours already set)."""
        self._computes.extend(computes)

    def add_host(self, host) -> None:
        """The host thread of an instance added while running: it shares cores with every worker on them."""
        host.neighbours = [o for o in self._computes if shares_compute(host.device, o.device, 1, o.tp)]
        for o in host.neighbours:
            o.neighbours.append(host)
        self._computes.append(host)

    # ---- request ends ----------------------------------------------------------------------------
    def complete(self, req: Req) -> None:
        if req.done:
            return
        req.done = True
        req.end = self.events.now()
        self._release(req)

    def fail(self, req: Req, kind: str, message: str) -> None:
        if req.done:
            return
        req.done = True
        req.end = self.events.now()
        req.error, req.error_kind = message, kind
        if req.stage is not None:
            req.stage.cancel(req)
            req.stage = None
        self._release(req)

    def expire(self, req: Req) -> None:
        self.fail(req, "timeout", "request timed out (the gateway's --request-timeout-s)")

    def _release(self, req: Req) -> None:
        if req.decode is not None:
            req.decode.drop(req)
        self.gateway.finished(req)
        self.outcomes.append(req)
        self.open -= 1

    # ---- running -----------------------------------------------------------------------------------
    def run(self, requests: Sequence[SimRequest]) -> SimResult:
        if not self.encoders and any(r.has_media for r in requests):
            raise ValueError("the workload has media but the topology has no encode instance (or monolith)")
        wall0 = time.perf_counter()
        reqs = [Req(r, self.model.media_tokens(r.modality, r.media)) for r in requests]
        self.open += len(reqs)
        if not self.exact_placement or self.gateway.admission is not None:
            self.poller.start()
        for r in reqs:
            self.events.at(r.spec.arrival_s, self.gateway.arrive, r)
        if self.online is not None:
            self.online.start(self, reqs)
        self.events.run()
        end = max((r.end for r in reqs if r.end is not None), default=0.0)  # not the last (stale) timeout
        wall = time.perf_counter() - wall0
        for r in reqs:  # nothing may stay open once the queue is empty
            if not r.done:
                raise RuntimeError(f"request {r.spec.index} neither completed nor failed; a simulator bug")
        names = [e.name for e in self.encoders]
        return SimResult(
            records=[r.record() for r in reqs], traces={e.name: trace_of(e.trace, end) for e in self.encoders},
            sim_seconds=end, wall_seconds=wall, events=self.events.processed,
            dispatches={n: e.batching.dispatches for n, e in zip(names, self.encoders)},
            routes={n: e.routes for n, e in zip(names, self.encoders)},
            admissions={d.name: d.admissions for d in self.decoders},
            busy_s={f"{c.kind}@{c.device}#{i}": c.busy_s for i, c in enumerate(self._computes)},
            decisions=list(self.gateway.admission.decided) if self.gateway.admission is not None else [],
            phases_ms=phases.means_ms(reqs))


def trace_of(trace, now: float, window: float | None = None) -> dict:
    """An encode instance's trace as its service's GET /trace answers (window: the whole run)."""
    window = max(now, 1e-3) if window is None else window
    spans = [{"kind": b.kind, "start": b.start, "end": b.end, "share": b.share, "batch": b.batch}
             for b in trace.spans(now - window)[-500:]]
    return {"now": now, "buckets": trace.buckets(now - window, now, max(window / 120, 0.05)), "spans": spans}


def simulate(topology: Topology, profile: Any, requests: Sequence[SimRequest],
             model_config: ModelConfig | None = None, profiles: Sequence[Any] = (), online=None, *,
             exact_placement: bool = False, service_model: ServiceModel | None = None) -> SimResult:
    """Run `requests` through `topology` with service times from `profile` (and, for instances of
    another tensor-parallel degree, from the one of `profiles` taken with it); `online`: an
    easerve.sim.online.OnlineDriver; `exact_placement`, `service_model`: see `Sim`."""
    return Sim(topology, profile, model_config, profiles, online, exact_placement, service_model).run(requests)
