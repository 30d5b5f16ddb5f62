"""The simulated instances: gateway, encode (+ co-located prefill), prefill, decode.

Each one drives the live policy objects (see topology.py) on the simulated clock and takes its
service times from a `ServiceModel`. Per request the path is the services': gateway
preprocessing (a pool of `--preprocess-threads`) -> a decode reservation (the engine
`Scheduler.reserve`, least-loaded instance) -> encode (batcher, then the deficit router per
request) -> local prefill on the encode's device or remote prefill over a link -> KV to the
reserving decode instance -> one token per decode step until max_tokens. Rejections follow
the services: a full gateway / encode / prefill (`--max-inflight`) or decode queue answers 429,
and so does the gateway's SLO-aware admission (easerve/sim/admission.py) refusing a request
predicted to miss its tier. Placement is by the instances' load reports (easerve/sim/reports.py);
encode and prefill keep the live caches (easerve/sim/caches.py).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

from easerve.policy.prefill_plan import PrefillBatcher, PrefillBatchPlan
from easerve.stages.encode.trace import UtilizationTrace
from easerve.errors import Overloaded, RequestTooLarge
from easerve.policy.service_model import ServiceModel
from easerve.sim.admission import SimAdmission, slo_of
from easerve.sim.caches import HIT, MISS, EncoderCache, PrefixCache
from easerve.sim.compute import Compute, SerialGroup
from easerve.sim.encode import EncodeBatching
from easerve.sim.host import HostWorker
from easerve.sim.events import EventQueue
from easerve.sim.reports import Poller, Reports
from easerve.sim.topology import (
    DEFAULT_EMBED_BYTES_PER_TOKEN,
    DEFAULT_KV_BYTES_PER_TOKEN,
    Topology,
    batcher_config,
    partitioner,
    prefill_batch_config,
    router,
    scheduler,
)
from easerve.sim.workload import Req


class Simulation(Protocol):
    """What an instance sees of the simulation it runs in (easerve.sim.run.Sim): the clock and
    the service times, the other instances it hands requests to, and the request ends."""

    events: EventQueue
    model: ServiceModel
    profile: object
    poller: Poller
    exact_placement: bool
    topology: Topology
    gateway: Gateway
    gateway_device: str
    encoders: list[EncodeInstance]
    text_prefills: list[PrefillWorker]
    remote_prefills: list[PrefillWorker]
    decoders: list[DecodeInstance]

    def complete(self, req: Req) -> None: ...

    def fail(self, req: Req, kind: str, message: str) -> None: ...

    def expire(self, req: Req) -> None: ...


def view(sim: Simulation, instances) -> Reports:
    """One caller's view of the instances `instances()` lists, polled with the others (the live
    `Peers`); a draining instance (easerve/sim/online.py) takes no new work."""
    v = Reports(instances, sim.exact_placement)
    sim.poller.views.append(v)
    return v


class Gateway:
    def __init__(self, sim: Simulation, cfg) -> None:
        self.sim, self.cfg = sim, cfg
        # the preprocessing threads (parse, media, tokenize: the profile's gateway points), each a
        # host thread on the gateway's cores; the rest of the gateway's host work per request
        # (HTTP, gRPC, streaming) is charged on arrival
        self.threads = tuple(HostWorker(sim.events, sim.model, sim.gateway_device, "gateway")
                             for _ in range(cfg.preprocess_threads))
        self.idle = list(self.threads)
        self.queue: deque[Req] = deque()
        self.inflight = 0
        self.places = {"encode": view(sim, lambda: sim.encoders), "prefill": view(sim, lambda: sim.text_prefills),
                       "decode": view(sim, lambda: sim.decoders)}
        self.admission = SimAdmission.of(cfg, sim.profile, sim.events.clock, *self.places.values())
        self.hostw = HostWorker(sim.events, sim.model, sim.gateway_device, "gateway")

    def arrive(self, req: Req) -> None:
        if self.inflight >= self.cfg.max_inflight:
            self.sim.fail(req, "http_429", "gateway: too many requests in flight")
            return
        self.inflight += 1
        req.at_gateway = True
        self.sim.events.after(self.cfg.request_timeout_s, self.sim.expire, req)
        rest = self.sim.model.config.host_of("gateway") - self._preprocess_s(req)
        self.hostw.run(max(0.0, rest), lambda: self._overhead(req))

    def _preprocess_s(self, req: Req) -> float:
        return self.sim.model.gateway_s(req.spec.modality, req.spec.media)

    def _overhead(self, req: Req) -> None:
        overhead = self.sim.model.config.request_overhead_s
        if req.done:
            return
        if overhead > 0.0:
            self.sim.events.after(overhead, self._take, req)
        else:
            self._take(req)

    def _take(self, req: Req) -> None:
        if req.done:
            return
        req.mark("taken", self.sim.events.now())
        self.queue.append(req)
        self._start()

    def _start(self) -> None:
        while self.idle and self.queue:
            req = self.queue.popleft()
            if req.done:
                continue
            worker = self.idle.pop()
            worker.run(self._preprocess_s(req), lambda req=req, worker=worker: self._preprocessed(req, worker))

    def _preprocessed(self, req: Req, worker: HostWorker) -> None:
        self.idle.append(worker)
        self._start()
        if req.done:
            return
        sim, now = self.sim, self.sim.events.now()
        req.mark("preprocessed", now)
        if self.admission is not None:
            d = req.admission = self.admission.admit(req)
            if d.action == "reject":
                sim.fail(req, "http_429", f"gateway: predicted to miss its SLO tier {d.tier.name!r}; "
                                          f"retry after {d.retry_after_s:.2f} s")
                return
            req.slo = slo_of(d, now)
        dec = self.places["decode"].pick(now)
        try:
            dec.reserve(req)
        except Overloaded as e:
            sim.fail(req, "http_429", str(e))
            return
        except RequestTooLarge as e:
            sim.fail(req, "http_400", str(e))
            return
        if self.admission is not None:
            self.admission.placed(req)
        if req.spec.has_media:
            self.places["encode"].pick(now).submit(req)
        else:
            self.places["prefill"].pick(now).submit(req, sim.gateway_device)

    def first_token(self, req: Req) -> None:
        if self.admission is not None:
            self.admission.first_token(req)

    def finished(self, req: Req) -> None:
        if self.admission is not None:
            self.admission.ended(req)
        if req.at_gateway:
            req.at_gateway = False
            self.inflight -= 1


class PrefillWorker:
    """A remote prefill instance, or the prefill co-located in an encode process (`host`)."""

    def __init__(self, sim: Simulation, cfg, device: str, name: str, host: EncodeInstance | None = None,
                 tp: int = 1) -> None:
        self.sim, self.cfg, self.name, self.host = sim, cfg, name, host
        self.planner = PrefillBatcher(prefill_batch_config(cfg))
        self.compute = Compute(sim.events, sim.model, "prefill", device, tp, host.name if host is not None else name,
                               host.compute.serial if host is not None else None)
        self.hostw = host.hostw if host is not None else HostWorker(sim.events, sim.model, device, name)
        self.capacity = cfg.max_inflight
        self.members: set[int] = set()   # requests it holds: in transit to it, queued or running
        self.reqs: dict[int, Req] = {}   # queued or running
        pc = cfg.prefix_cache
        self.prefix = (PrefixCache(pc, sim.model.kv_bytes_per_token() or DEFAULT_KV_BYTES_PER_TOKEN)
                       if pc is not None else None)

    @property
    def device(self) -> str:
        return self.compute.device

    @property
    def outstanding(self) -> int:
        return len(self.members)

    def submit(self, req: Req, from_device: str) -> None:
        """The request's embeddings leave `from_device` now; queue it when they arrive."""
        if self.outstanding >= self.capacity:
            self.sim.fail(req, "http_429", f"{self.name}: too many requests in flight")
            return
        self.members.add(req.spec.index)
        req.stage = self
        model = self.sim.model
        delay = model.transfer_s(model.embed_bytes(req.media_tokens), model.link_kind(from_device, self.device))
        self.sim.events.after(delay, self._arrived, req)

    def _arrived(self, req: Req) -> None:
        if req.done:
            return
        cfg = self.sim.model.config
        if self.host is not None and self.host.stage == "monolith":  # charged once: at encode, or here for text
            work = 0.0 if req.spec.has_media else cfg.host_of("monolith")
        else:  # a prefill process, or the prefill co-located in an encode process
            work = cfg.host_of("prefill")
        self.hostw.run(work, lambda: self._queue(req))

    def _queue(self, req: Req) -> None:
        if req.done:
            return
        self.reqs[req.spec.index] = req
        tokens = self.prefix.to_compute(req) if self.prefix is not None else req.prompt_tokens
        deadline, yields = req.slo if req.slo is not None else (None, False)
        self.planner.add(req.spec.index, tokens, self.sim.events.now(), deadline, yields)
        self._kick()

    def cancel(self, req: Req) -> None:
        self.members.discard(req.spec.index)
        if self.reqs.pop(req.spec.index, None) is not None and self.planner.remove(req.spec.index) \
                and self.prefix is not None:
            self.prefix.forget(req.spec.index)

    def _kick(self) -> None:
        if self.compute.busy_kind is not None or not self.compute.acquire(self._kick):
            return
        now = self.sim.events.now()
        plan = self.planner.next_batch(now)
        if plan is None:
            self.compute.release()
            return
        tokens = plan.total_tokens if self.prefix is None else sum(
            self.prefix.lookup(self.reqs[rid]) for rid in plan.request_ids)  # what the forward computes
        base = self.sim.model.prefill_s(tokens, plan.size, self.compute.tp)
        self.compute.start("prefill", base, lambda: self._done(plan, now), self._factor)

    def _factor(self) -> float:
        h = self.host
        if h is None or h.alloc is None or h.alloc.encode_share == 1.0 and h.alloc.prefill_share == 1.0:
            return self.compute.factor()  # time-sliced with whatever shares the device
        other = self.compute.factor(skip=h.compute)
        if h.compute.busy_kind is None:
            return other
        if h.alloc.prefill_share > 0:
            return max(other, 1.0 / h.alloc.prefill_share)
        return max(other, self.sim.model.slowdown("prefill", "encode", not self.device.startswith("cuda")))

    def _done(self, plan: PrefillBatchPlan, t0: float) -> None:
        now = self.sim.events.now()
        self.compute.release()
        self.planner.on_free(now)  # the live planner is work-conserving: it plans again once told
        if self.host is not None:
            a = self.host.alloc
            self.host.trace.record("prefill", t0, now, a.prefill_share if a is not None and a.prefill_share > 0 else 1.0,
                                   plan.size)
        model = self.sim.model
        for rid in plan.request_ids:
            req = self.reqs.pop(rid, None)
            self.members.discard(rid)
            if self.prefix is not None:
                self.prefix.done(rid)
            if req is None or req.done:
                continue
            req.mark("prefill_start", t0)
            req.mark("prefill_end", now)
            req.stage = None
            req.tokens.append(now)  # the first token leaves prefill for the gateway at once
            self.sim.gateway.first_token(req)
            if req.spec.max_tokens == 1:
                self.sim.complete(req)
                continue
            dec = req.decode
            delay = model.transfer_s(model.kv_bytes(req.prompt_tokens), model.link_kind(self.device, dec.device))
            req.stage = dec
            self.sim.events.after(delay, dec.add, req)
        self._kick()


class EncodeInstance:
    """An encode service, or with `serial` (a monolith's) the encode of a monolith process."""

    def __init__(self, sim: Simulation, cfg, name: str, tp: int = 1, serial: SerialGroup | None = None,
                 stage: str = "encode") -> None:
        self.sim, self.cfg, self.name, self.stage = sim, cfg, name, stage
        self.hostw = HostWorker(sim.events, sim.model, cfg.device, name)
        self.batching = EncodeBatching(batcher_config(cfg))
        self.router = router(cfg)
        self.partitioner = partitioner(cfg, sim.model.for_tp(tp, name))
        self.compute = Compute(sim.events, sim.model, "encode", cfg.device, tp, name, serial)
        self.local = (PrefillWorker(sim, cfg, cfg.device, f"{name}/prefill", host=self, tp=tp)
                      if cfg.colocate_prefill else None)
        self.capacity = cfg.max_inflight
        self.members: set[int] = set()   # requests it holds: queued or encoding
        self.reqs: dict[int, Req] = {}   # queued in the batcher
        self.alloc = None          # the partition of the batch running now
        self.trace = UtilizationTrace()
        self.routes: list[str] = []
        self._timer: float | None = None
        self._remote = view(sim, lambda: sim.remote_prefills)
        self.cache = EncoderCache(cfg.encoder_cache_gb) if cfg.encoder_cache_gb > 0 else None

    def submit(self, req: Req) -> None:
        if self.outstanding >= self.capacity:
            self.sim.fail(req, "http_429", f"{self.name}: too many requests in flight")
            return
        self.members.add(req.spec.index)
        req.stage = self
        self.hostw.run(self.sim.model.config.host_of(self.stage), lambda: self._look_up(req))

    def _look_up(self, req: Req) -> None:
        """Held media skip the batcher; media another request encodes wait for it; the rest queue."""
        if req.done:
            return
        req.mark("encode_in", self.sim.events.now())
        state = self.cache.lookup(req) if self.cache is not None else MISS
        if state == HIT:
            self._route(req)
        elif state == MISS:
            self.reqs[req.spec.index] = req
            now = self.sim.events.now()
            deadline, yields = req.slo if req.slo is not None else (None, False)
            self.batching.arrive(req.spec.index, now, deadline, yields)
            self._kick()
            self._arm(now)

    @property
    def outstanding(self) -> int:
        return len(self.members)

    def cancel(self, req: Req) -> None:
        self.members.discard(req.spec.index)
        if self.reqs.pop(req.spec.index, None) is not None:
            self.batching.remove(req.spec.index)
        if self.cache is not None:
            for w in self.cache.abandoned(req):  # its waiters: the first takes the encode over
                self._look_up(w)

    def _arm(self, now: float) -> None:
        due = self.batching.next_deadline(now)
        if due is not None and (self._timer is None or due < self._timer):
            self._timer = max(due, now)
            self.sim.events.at(self._timer, self._on_timer)

    def _on_timer(self) -> None:
        now = self.sim.events.now()
        if self._timer is not None and self._timer <= now:
            self._timer = None
        self.batching.poll(now)
        self._kick()
        self._arm(now)

    def _kick(self) -> None:
        if self.compute.busy_kind is not None or not self.batching.ready or not self.compute.acquire(self._kick):
            return
        while True:
            d = self.batching.next_for_worker()
            if d is None:
                self.compute.release()
                return
            reqs = [r for r in (self.reqs.pop(i, None) for i in d.item_ids) if r is not None]
            if reqs:
                break
            self.batching.worker_free(self.sim.events.now())  # every item was cancelled: free at once
        now = self.sim.events.now()
        self.alloc = self.partitioner.choose(len(reqs)) if self.partitioner is not None else None
        share = self.alloc.encode_share if self.alloc is not None else 1.0
        groups: dict[tuple[str, str], int] = {}
        for r in reqs:
            groups[(r.spec.modality, r.spec.media)] = groups.get((r.spec.modality, r.spec.media), 0) + 1
        base = self.sim.model.encode_batch_s(groups, share, self.compute.tp)
        partitioned = self.alloc is not None and not (self.alloc.encode_share == 1.0 and self.alloc.prefill_share == 1.0)
        skip = self.local.compute if partitioned else None
        self.compute.start("encode", base, lambda: self._done(reqs, now, share), lambda: self.compute.factor(skip))

    def _done(self, reqs: list[Req], t0: float, share: float) -> None:
        now = self.sim.events.now()
        self.compute.release()
        self.trace.record("encode", t0, now, share, len(reqs))
        self.batching.worker_free(now)
        model = self.sim.model
        for req in reqs:
            req.mark("encode_start", t0)
            req.mark("encode_end", now)
            size = model.embed_bytes(req.media_tokens) or req.media_tokens * DEFAULT_EMBED_BYTES_PER_TOKEN
            waiters = self.cache.encoded(req, size) if self.cache is not None else []
            for r in (req, *waiters):
                if not r.done:
                    self._route(r)
        self._kick()
        self._arm(now)

    def _route(self, req: Req) -> None:
        """Its embeddings are ready: to the co-located prefill or a remote one (the router)."""
        self.members.discard(req.spec.index)
        req.stage = None
        route = self.router.route()
        self.routes.append(route)
        if route == "local":
            self.local.submit(req, self.cfg.device)
        else:
            target = self._remote.pick(self.sim.events.now())
            if target is None:
                self.sim.fail(req, "http_503", f"{self.name}: no remote prefill instance")
            else:
                target.submit(req, self.cfg.device)


class DecodeInstance:
    """A decode service, or with `host` (a monolith's encode) the decode of that monolith process."""

    def __init__(self, sim: Simulation, cfg, name: str, tp: int = 1, host: EncodeInstance | None = None) -> None:
        self.sim, self.cfg, self.name = sim, cfg, name
        self.sched = scheduler(cfg, sim.model.kv_bytes_per_token(), sim.topology.gpu_kv_gb, tp)
        self.host = host
        self.hostw = host.hostw if host is not None else HostWorker(sim.events, sim.model, cfg.device, name)
        self.compute = Compute(sim.events, sim.model, "decode", cfg.device, tp, host.name if host is not None else name,
                               host.compute.serial if host is not None else None)
        self.capacity = 0
        self.held: dict[int, Req] = {}
        self.admissions: list[tuple[str, ...]] = []
        self.steps = 0

    @property
    def device(self) -> str:
        return self.compute.device

    @property
    def outstanding(self) -> int:
        return len(self.held)

    def reserve(self, req: Req) -> None:
        self.sched.reserve(str(req.spec.index), req.prompt_tokens, req.spec.max_tokens, self.sim.events.now(),
                           self.sim.gateway.cfg.request_timeout_s)
        self.held[req.spec.index] = req
        req.decode = self

    def drop(self, req: Req) -> None:
        if self.held.pop(req.spec.index, None) is not None:
            self.sched.abort(str(req.spec.index))

    def cancel(self, req: Req) -> None:
        self.drop(req)

    def add(self, req: Req) -> None:
        if req.done:
            return
        self.hostw.run(0.0 if self.host is not None else self.sim.model.config.host_of("decode"),
                       lambda: self._queue(req))

    def _queue(self, req: Req) -> None:
        if req.done:
            return
        try:
            self.sched.add(str(req.spec.index), req.prompt_tokens, req.spec.max_tokens)
        except Overloaded as e:  # the reservation lapsed and the queue is full
            self.held.pop(req.spec.index, None)
            self.sim.fail(req, "http_429", str(e))
            return
        self._kick()

    def _kick(self) -> None:
        if self.compute.busy_kind is not None or not self.sched.has_work or not self.compute.acquire(self._kick):
            return
        plan = self.sched.schedule()
        if plan.admitted:
            self.admissions.append(plan.admitted)
        n = plan.batch_size
        if n == 0:
            self.compute.release()
            return
        ctx = sum(self.held[int(r)].prompt_tokens + len(self.held[int(r)].tokens) for r in plan.request_ids) // n
        self.steps += 1
        rids = plan.request_ids
        self.compute.start("decode", self.sim.model.decode_step_s(n, ctx, self.compute.tp), lambda: self._stepped(rids))

    def _stepped(self, rids: tuple[str, ...]) -> None:
        now = self.sim.events.now()
        self.compute.release()
        finished = []
        for rid in rids:
            req = self.held.get(int(rid))
            if req is None:
                continue
            req.tokens.append(now)
            if len(req.tokens) >= req.spec.max_tokens:
                finished.append(rid)
                del self.held[req.spec.index]
                req.stage = None
                self.sim.complete(req)
        self.sched.update_from_output(finished)
        self._kick()
