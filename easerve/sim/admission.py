"""The gateway's SLO-aware admission on the simulated clock.

Built as the live gateway builds it (easerve/stages/gateway/admission.py `GatewayAdmission`):
present when the topology's `GatewayConfig.profile` is set (the simulator predicts from the
profile it runs on, whatever file the field names), an `Admission` of `--admission` over a
`LatencyPredictor` of that profile's `ServiceModel`, calibrated unless
`--no-admission-calibration`. Each preprocessed request is decided on the state
`easerve.policy.gateway_state.live_state` makes of the gateway's load reports (easerve/sim/reports.py)
and of the admitted requests with no first token yet, as live. The gateway carries the decision
out (easerve/sim/stages.py): reject -> 429; otherwise the request carries its tier deadline and
whether it yields (`slo_of`) to the encode batcher and the prefill planner's deadline order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from easerve.policy.admission import Admission, Decision
from easerve.policy.calibration import Calibration
from easerve.policy.clock import Clock
from easerve.policy.gateway_state import Unserved, live_state, tier_limits
from easerve.policy.latency import LatencyPredictor, LiveState, RequestShape
from easerve.policy.service_model import ServiceModel
from easerve.sim.reports import Reports
from easerve.sim.workload import Req
from easerve.stages.common.configs import GatewayConfig


@dataclass(frozen=True)
class Decided:
    """One decision and what it was made from (for tests and traces)."""
    index: int
    at: float
    shape: RequestShape
    state: LiveState
    decision: Decision


def slo_of(decision: Decision, now: float) -> tuple[float, bool]:
    """(deadline, yields) as a stage reads them from the gateway's `RequestMeta` sent at `now`:
    `slo_ttft_ms` is the deadline's distance in whole milliseconds (at least 1)."""
    return now + max(1, round((decision.deadline - now) * 1000)) / 1000.0, decision.yields


class SimAdmission:
    def __init__(self, cfg: GatewayConfig, profile: Any, clock: Clock, enc: Reports, pre: Reports,
                 dec: Reports) -> None:
        self.cfg, self.profile, self.clock = cfg, profile, clock
        self._enc, self._pre, self._dec = enc, pre, dec
        calibration = None if cfg.no_admission_calibration else Calibration(clock)
        self.policy = Admission(cfg.admission, LatencyPredictor(ServiceModel(profile), clock, calibration), clock,
                                cfg.admission_probe_s)
        self.unserved: dict[int, Unserved] = {}   # admitted, no first token yet
        self.decided: list[Decided] = []

    @classmethod
    def of(cls, cfg: GatewayConfig, profile: Any, clock: Clock, enc: Reports, pre: Reports,
           dec: Reports) -> SimAdmission | None:
        """None without --profile, as live (nothing is predicted, no deadline is sent)."""
        return cls(cfg, profile, clock, enc, pre, dec) if cfg.profile else None

    def state(self) -> LiveState:
        return live_state(self._enc.up_reports(), self._pre.up_reports(), self._dec.up_reports(),
                          self.unserved.values(), self.clock.now(), self.cfg.admission_encode_batch,
                          self.cfg.admission_prefill_tokens)

    def admit(self, req: Req) -> Decision:
        """The live `GatewayAdmission.admit`: the request's tier (its own, else --slo-tier) and
        priority class (its own, else --priority), predicted from the state now."""
        s = req.spec
        tier = tier_limits(self.profile, s.tier or self.cfg.slo_tier, s.modality)
        shape = RequestShape(s.modality, "", max(1, req.prompt_tokens), s.max_tokens, 1)
        state = self.state()
        d = self.policy.decide(shape, state, tier, s.priority or self.cfg.priority, s.arrival_s)
        self.decided.append(Decided(s.index, self.clock.now(), shape, state, d))
        if d.action != "reject":
            self.unserved[s.index] = Unserved("encode" if s.has_media else "prefill", d.deadline, d.yields)
        return d

    def placed(self, req: Req) -> None:
        if (u := self.unserved.get(req.spec.index)) is not None:
            u.placed = True

    def first_token(self, req: Req) -> None:
        """Its first token left: the calibration learns the actual TTFT."""
        self.unserved.pop(req.spec.index, None)
        if req.admission is not None:
            self.policy.predictor.observe_ttft(req.admission.prediction, self.clock.now() - req.spec.arrival_s,
                                              req.admission.probe)

    def ended(self, req: Req) -> None:
        """Done or failed; a finished request of several tokens teaches the calibration its TPOT."""
        self.unserved.pop(req.spec.index, None)
        toks = req.tokens
        if req.admission is not None and req.error is None and len(toks) > 1:
            self.policy.predictor.observe_tpot(req.admission.prediction, (toks[-1] - toks[0]) / (len(toks) - 1),
                                              req.admission.probe)
