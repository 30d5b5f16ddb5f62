"""SLO-aware admission: admit, admit as best-effort, or refuse a request predicted to miss its tier.

Pure, with an injected clock: `Admission.decide` takes the request's shape, the live state,
its tier's limits and its priority class, asks the `LatencyPredictor`, and returns a typed
`Decision` the gateway carries out (`reject` -> RESOURCE_EXHAUSTED / 429 with the decision's
`retry_after_s`). Modes (`--admission`): `off` admits everything (the prediction is still made,
so predicted and actual TTFT can be compared); `reject` refuses a predicted miss; `best-effort`
admits it marked best-effort. A request misses when its predicted TTFT (the time it already
spent, `received` to now, plus the predicted rest) is over the tier's TTFT limit, or its
predicted TPOT over the TPOT limit, each times the prediction's margin (the scatter the
calibration saw while admission refuses little; easerve/policy/calibration.py). The prediction
knows the request's deadline and whether it yields (`batch`), so it counts only the queued
requests the deadline order puts ahead of it.

A `reject` admission that has admitted nothing for `probe_s` admits the next predicted miss as a
probe (`Decision.probe`): the calibration then takes that request's actual latency as the present
truth (easerve/policy/calibration.py). Without it, a correction learned in an overload could
refuse every later request for ever, since only admitted requests report back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from easerve.fields import Checked, PosFloat
from easerve.policy.clock import Clock
from easerve.policy.latency import LatencyPredictor, LiveState, Prediction, RequestShape, retry_after_s

AdmissionMode = Literal["off", "reject", "best-effort"]
Priority = Literal["interactive", "batch"]
TierName = Literal["tight", "moderate", "loose"]  # the profile's tiers (easerve/profile_format.py TIERS)
ADMISSION_MODES: tuple[str, ...] = get_args(AdmissionMode)
PRIORITIES: tuple[str, ...] = get_args(Priority)
TIER_NAMES: tuple[str, ...] = get_args(TierName)
Action = Literal["admit", "best_effort", "reject"]


@dataclass(frozen=True)
class TierLimits(Checked):
    """One SLO tier's limits for the request's modality, in seconds."""
    ttft_s: PosFloat
    tpot_s: PosFloat
    name: TierName = "moderate"


@dataclass(frozen=True)
class Decision:
    action: Action
    tier: TierLimits
    priority: Priority
    prediction: Prediction
    deadline: float                 # the clock's time the first token must leave by to meet the tier
    retry_after_s: float | None = None  # set on a predicted miss: when a retry would be predicted to meet it
    probe: bool = False             # a predicted miss admitted because nothing was admitted for probe_s

    @property
    def predicted_miss(self) -> bool:
        return self.retry_after_s is not None

    @property
    def yields(self) -> bool:
        """Its request goes behind every one that can still meet its tier (the queues' deadline
        order): admitted best-effort, or of the `batch` class."""
        return self.action == "best_effort" or self.priority == "batch"


class Admission:
    def __init__(self, mode: AdmissionMode, predictor: LatencyPredictor, clock: Clock, probe_s: float = 1.0) -> None:
        """`probe_s`: in `reject` mode, the longest run of refusals before a predicted miss is
        admitted as a probe (0: never)."""
        if mode not in ADMISSION_MODES:
            raise ValueError(f"--admission must be one of {list(ADMISSION_MODES)}, got {mode!r}")
        if probe_s < 0:
            raise ValueError(f"--admission-probe-s must be >= 0 (0: no probes), got {probe_s}")
        self.mode, self.predictor, self.clock, self.probe_s = mode, predictor, clock, probe_s
        self._last_admit = clock.now()

    def decide(self, req: RequestShape, state: LiveState, tier: TierLimits, priority: Priority,
               received: float) -> Decision:
        now = self.clock.now()
        pred = self.predictor.predict(req, state, elapsed_s=max(0.0, now - received),
                                      due_s=tier.ttft_s, yields=priority == "batch")
        deadline = received + tier.ttft_s
        miss = pred.ttft_s > tier.ttft_s * pred.ttft_margin or pred.tpot_s > tier.tpot_s * pred.tpot_margin
        if not miss:
            self._admitted(now)
            return Decision("admit", tier, priority, pred, deadline)
        retry = retry_after_s(pred, tier.ttft_s, tier.tpot_s, req.max_tokens)
        if self.mode == "reject":
            if self.probe_s and now - self._last_admit >= self.probe_s:
                self._admitted(now)
                return Decision("admit", tier, priority, pred, deadline, retry, probe=True)
            # no actual will come back: the calibration scores its shadow
            self.predictor.refused(pred, tier.ttft_s)
            return Decision("reject", tier, priority, pred, deadline, retry)
        self._admitted(now)
        if self.mode == "best-effort":
            return Decision("best_effort", tier, priority, pred, deadline, retry)
        return Decision("admit", tier, priority, pred, deadline, retry)  # off: admitted, the miss still noted

    def _admitted(self, now: float) -> None:
        """A request goes in (admitted, as a probe, or best-effort): the probe's clock restarts
        and the calibration counts it."""
        self._last_admit = now
        self.predictor.admitted()
