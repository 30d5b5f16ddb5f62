"""Online calibration of the latency predictor against what requests actually got.

The predictor (easerve/policy/latency.py) is built from the profile and each instance's
recent pace, so it misses what neither sees: stages that slow each other on shared cores,
queues outside the batchers, the transfers between stages. A `Calibration` keeps, for TTFT
and for TPOT separately, a moving average of log(actual / predicted) over the requests that
finished their first token (TTFT) or their stream (TPOT), and the predictor multiplies its
raw prediction by exp(that average). The average relaxes toward 0 (a factor of 1) with a
half-life of `half_life_s` between samples, so a factor learned under a past overload cannot
keep refusing requests once no admitted request reports back; it stays within
[1 / `max_factor`, `max_factor`]. Pure, with an injected clock."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from easerve.policy.clock import Clock


@dataclass
class _LogRatio:
    value: float = 0.0
    at: float = 0.0
    samples: int = 0


@dataclass
class Calibration:
    clock: Clock
    alpha: float = 0.2          # weight of the newest request
    half_life_s: float = 10.0   # relaxation toward a factor of 1 without samples
    max_factor: float = 8.0
    _ttft: _LogRatio = field(default_factory=_LogRatio)
    _tpot: _LogRatio = field(default_factory=_LogRatio)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"calibration alpha must be in (0, 1], got {self.alpha}")
        if self.half_life_s <= 0.0 or self.max_factor < 1.0:
            raise ValueError("calibration half_life_s must be > 0 and max_factor >= 1")

    def ttft_factor(self) -> float:
        return self._factor(self._ttft)

    def tpot_factor(self) -> float:
        return self._factor(self._tpot)

    def observe_ttft(self, raw_predicted_s: float, actual_s: float) -> None:
        """One request's first token: its uncalibrated prediction and what it got."""
        self._observe(self._ttft, raw_predicted_s, actual_s)

    def observe_tpot(self, raw_predicted_s: float, actual_s: float) -> None:
        self._observe(self._tpot, raw_predicted_s, actual_s)

    # ---------------------------------------------------------------------------------------------
    def _relaxed(self, r: _LogRatio) -> float:
        if r.samples == 0:
            return 0.0
        return r.value * 0.5 ** (max(0.0, self.clock.now() - r.at) / self.half_life_s)

    def _factor(self, r: _LogRatio) -> float:
        bound = math.log(self.max_factor)
        return math.exp(min(bound, max(-bound, self._relaxed(r))))

    def _observe(self, r: _LogRatio, raw_predicted_s: float, actual_s: float) -> None:
        if raw_predicted_s <= 0.0 or actual_s <= 0.0:
            return
        sample = math.log(actual_s / raw_predicted_s)
        current = self._relaxed(r)
        r.value = sample if r.samples == 0 else current + self.alpha * (sample - current)
        r.at, r.samples = self.clock.now(), r.samples + 1
