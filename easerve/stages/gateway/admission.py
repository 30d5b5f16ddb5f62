"""The gateway's side of SLO-aware admission (easerve/policy/admission.py decides).

With `--profile`, every preprocessed request (media or text only) is predicted
(easerve/policy/latency.py over the `ServiceModel` of that profile, easerve/policy/service_model.py) from what the
gateway sees of the stages: each instance's last `Stage/Load` answer (queued requests and how
many of them the deadline order puts last, decode's KV room) plus the calls it started there since,
and what it knows itself of the requests it admitted that have no first token yet:
- those not sent to their first stage yet count in that stage's queue (a burst is admitted while
  its first requests still wait for decode's reservation: without them, each of the burst would
  see empty queues);
- those sent but not in encode's count are past encode: prefill's queue is at least that many,
  and at least as many of them are overdue as the gateway counts (deadline passed, or yielding)
  beyond encode's overdue. Prefill's own answer is up to a poll old, and the encode instances
  send it work the gateway never sees sent.
What is added to a stage is spread evenly over its instances (easerve/policy/gateway_state.py
`live_state`, which the simulator's gateway calls too).

`--admission reject` refuses a predicted miss with `Overloaded` (429 / RESOURCE_EXHAUSTED) whose
Retry-After is the decision's; `best-effort` lets it in marked best-effort. The predictor is
calibrated online by the actual TTFT and TPOT of the requests it admitted
(easerve/policy/calibration.py); after --admission-probe-s of refusals one request is admitted
as a probe, so a correction learned in an overload cannot refuse every later request. Each request's prediction and its actual TTFT / TPOT go to the
metrics and to a bounded list of records served at GET /trace.
"""
from __future__ import annotations

import time
from collections import deque

from easerve.errors import BadRequest, Overloaded
from easerve.policy.admission import PRIORITIES, TIER_NAMES, Admission, Decision, TierLimits
from easerve.policy.calibration import Calibration
from easerve.policy.clock import Clock, MonotonicClock
from easerve.policy.gateway_state import Unserved, live_state, tier_limits
from easerve.policy.latency import LatencyPredictor, LiveState, RequestShape
from easerve.policy.service_model import ServiceModel
from easerve.stages.gateway.job import Job

TRACE_RECORDS = 4096
TIER_HEADER, PRIORITY_HEADER = "x-easerve-slo-tier", "x-easerve-priority"


def checked_tier(value: str | None, where: str) -> str | None:
    if value is not None and value not in TIER_NAMES:
        raise BadRequest(f"{where} {value[:40]!r} is not an SLO tier; use one of {', '.join(TIER_NAMES)}")
    return value


def checked_priority(value: str | None, where: str) -> str | None:
    if value is not None and value not in PRIORITIES:
        raise BadRequest(f"{where} {value[:40]!r} is not a priority class; use one of {', '.join(PRIORITIES)}")
    return value


class GatewayAdmission:
    def __init__(self, cfg, profile, enc, pre, dec, metrics, clock: Clock | None = None) -> None:
        self.cfg, self.profile, self.m = cfg, profile, metrics
        self._enc, self._pre, self._dec = enc, pre, dec
        self.clock = clock or MonotonicClock()
        calibration = None if cfg.no_admission_calibration else Calibration(self.clock)
        self.policy = Admission(cfg.admission, LatencyPredictor(ServiceModel(profile), self.clock, calibration),
                                self.clock, cfg.admission_probe_s)
        self.records: deque[dict] = deque(maxlen=TRACE_RECORDS)
        self._unserved: dict[str, Unserved] = {}  # admitted, no first token yet

    @classmethod
    def of(cls, cfg, enc, pre, dec, metrics) -> GatewayAdmission | None:
        """None without --profile (nothing to predict from)."""
        if not cfg.profile:
            return None
        from easerve import profile_format as pf
        try:
            profile = pf.load(cfg.profile)
        except (OSError, ValueError) as e:
            raise ValueError(f"--profile {cfg.profile}: {e}") from None
        return cls(cfg, profile, enc, pre, dec, metrics)

    # ---- the live state ------------------------------------------------------------------------
    def state(self) -> LiveState:
        return live_state(self._enc.up_peers(), self._pre.up_peers(), self._dec.up_peers(), self._unserved.values(),
                          self.clock.now(), self.cfg.admission_encode_batch, self.cfg.admission_prefill_tokens)

    def tier(self, name: str, modality: str) -> TierLimits:
        return tier_limits(self.profile, name, modality)

    # ---- per request ---------------------------------------------------------------------------
    def admit(self, job: Job, modality: str, prompt_tokens: int) -> Decision:
        """Decide; a reject raises Overloaded with the decision's Retry-After."""
        tier = self.tier(job.slo_tier or self.cfg.slo_tier, modality)
        priority = job.priority or self.cfg.priority
        shape = RequestShape(modality, "", max(1, prompt_tokens), job.sampling.max_tokens, job.sampling.n)
        state = self.state()
        d = self.policy.decide(shape, state, tier, priority, job.received)
        p = d.prediction
        job.admission = d
        self.m.admissions.inc(decision=d.action, tier=tier.name, priority=priority)
        self.m.predicted_ttft.observe(p.ttft_s)
        job.trace = rec = {"request_id": job.request_id, "received": time.time() - (self.clock.now() - job.received),
                           "modality": modality, "tier": tier.name, "priority": priority, "decision": d.action, "probe": d.probe,
                           "predicted_ttft_ms": p.ttft_s * 1e3,
                           "elapsed_ms": p.elapsed_s * 1e3,
                           # the raw model's parts and what it saw, to study the calibration offline
                           "raw_queue_ms": p.queue_s * 1e3, "raw_service_ms": (p.gateway_s + p.encode_s + p.prefill_s) * 1e3,
                           "seen_queued": [sum(e.queued for e in state.encode), sum(q.queued for q in state.prefill),
                                           sum(q.waiting for q in state.decode)],
                           "seen_overdue": [sum(e.overdue for e in state.encode),
                                            sum(q.overdue for q in state.prefill)],
                           "demoted": p.demoted,
                           "state_age_ms": max(0.0, self.clock.now() - state.taken_at) * 1e3,
                           "predicted_tpot_ms": p.tpot_s * 1e3,
                           "ttft_factor": p.ttft_factor, "tpot_factor": p.tpot_factor,
                           "ttft_margin": p.ttft_margin, "tpot_margin": p.tpot_margin,
                           "ttft_limit_ms": tier.ttft_s * 1e3, "tpot_limit_ms": tier.tpot_s * 1e3,
                           "retry_after_s": d.retry_after_s, "ttft_ms": None, "tpot_ms": None}
        self.records.append(rec)
        if d.action != "reject":
            self._unserved[job.request_id] = Unserved("encode" if shape.has_media else "prefill", d.deadline,
                                                       d.yields)
        if d.action == "reject":
            raise Overloaded(f"request {job.request_id} is predicted to miss its SLO tier {tier.name!r} "
                             f"(TTFT {p.ttft_s * 1e3:.0f} ms predicted, limit {tier.ttft_s * 1e3:.0f} ms; "
                             f"TPOT {p.tpot_s * 1e3:.1f} ms, limit {tier.tpot_s * 1e3:.1f} ms); "
                             f"retry after {d.retry_after_s:.2f} s or ask for a looser tier",
                             retry_after_s=d.retry_after_s)
        return d

    def placed(self, job: Job) -> None:
        """The admitted request is being sent to its first stage: from now on that stage's own
        count has it."""
        if (u := self._unserved.get(job.request_id)) is not None:
            u.placed = True

    def ended(self, job: Job) -> None:
        """The request got its first token, or ended without one."""
        self._unserved.pop(job.request_id, None)

    def first_token(self, job: Job, ttft_s: float) -> None:
        self.ended(job)
        if job.trace is None:
            return
        job.trace["ttft_ms"] = ttft_s * 1e3
        pred = job.admission.prediction
        self.m.ttft_prediction_error.observe(abs(pred.ttft_s - ttft_s) / max(ttft_s, 1e-9))
        self.policy.predictor.observe_ttft(pred, ttft_s, job.admission.probe)

    def finished(self, job: Job, tpot_s: float | None) -> None:
        if job.trace is not None and tpot_s is not None:
            job.trace["tpot_ms"] = tpot_s * 1e3
            self.policy.predictor.observe_tpot(job.admission.prediction, tpot_s, job.admission.probe)

    def trace(self, last: int) -> dict:
        recs = list(self.records)[-last:] if last > 0 else []
        return {"admission": self.cfg.admission, "default_tier": self.cfg.slo_tier, "requests": recs}
