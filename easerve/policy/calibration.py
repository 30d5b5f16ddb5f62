"""Online calibration of the latency predictor against what requests actually got.

The predictor (easerve/policy/latency.py) is built from the profile and each instance's
recent pace, so it misses what neither sees: stages that slow each other on shared cores,
queues outside the batchers, the transfers between stages. A `Calibration` keeps, for TTFT
and for TPOT separately, two moving averages of log(actual / predicted) over the requests
that finished their first token (TTFT) or their stream (TPOT), and the predictor multiplies
its raw prediction by exp(the fast one):
- the slow one (`slow_alpha`) is the deployment's lasting bias (e.g. a profile taken with
  more threads than the stage runs), learned only from requests predicted to wait in no
  queue (`waits_in_no_queue`: a raw queue wait of at most a tenth of the raw TTFT; for TPOT, no
  decode wait), so an overload does not move it;
- the fast one (`alpha`) follows the load of the moment, and between samples it relaxes
  toward the slow one with a half-life of `half_life_s`, so a factor learned in a past
  overload cannot keep refusing requests once no admitted request reports back.
- which one a prediction takes: a request predicted to wait in a queue takes the fast one; a
  request predicted to wait in none (`uncongested=True`) takes the lesser of the two while
  admission refuses under `overload_share` of its decisions (a moving share, `share_alpha` the
  weight of the newest). The lasting bias is what requests like it got;
  the fast average, a few requests' worth (alpha 0.3), swings by 20-40 % at a light load with
  no change in it (0.83-1.41 at 0.7x of the SLO capacity in bench/admission.py's run at
  f51ad98), and a request near its limit with no queue ahead is refused only when both say it
  misses. Once admission refuses a share of the load, the stack is turning load away, and "no
  queue" may be what the raw model fails to see (an instance just restarted after a kill reports
  empty queues and runs slow at first): every request takes the fast factor again. (Without that
  condition, the 10-minute chaos soak at b4db402 kept 0.597 of its fault-free goodput under
  faults; with "nothing refused for 5 s" in its place, 4657aab, 0.905, but one refusal at a light
  load then switched the fast factor on for everyone and the refusals that followed kept it on.)
- a request refused for the correction alone (`refused`: its raw prediction met the limit) is
  scored against a shadow estimate of what it would have taken, its raw prediction times the
  lasting bias: the fast average moves toward the slow one as if it had come back so. The
  calibration does not learn only from the requests it let in: a factor a burst inflated
  stops refusing a light load after a refusal or two, not after seconds of refusals.
- a probe (a request admission let in after `probe_s` of refusals, easerve/policy/admission.py)
  is the present truth: the fast average becomes its sample. A lasting bias learned in an
  overload (whose queues the raw model does not see, so its samples pass for uncongested) would
  otherwise refuse every request for ever, the refusals' shadows pulling only toward that bias;
  after a probe, the requests it lets in teach the lasting bias again.
- the miss margin (`ttft_margin`, `tpot_margin`): the no-queue samples scatter around the
  lasting bias (first tokens on shared cores, a lognormal of sigma 0.1-0.3), so a prediction a
  little over its limit is nearly as likely to meet it as to miss. While admission refuses under
  `overload_share`, it calls a request a miss only beyond its limit times exp(that scatter: the
  root of a slow average of squared deviations, `slow_alpha`), at most `max_margin`, once
  `margin_samples` such samples came back; under overload, at its limit. (At f51ad98-fb53493
  bench/admission.py's light loads were refused for predictions 1.01-1.17x their limit whose
  requests met it about a third of the time.)
Both factors stay within [1 / `max_factor`, `max_factor`]. Pure, with an injected clock."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from easerve.policy.clock import Clock


def waits_in_no_queue(raw_queue_s: float, raw_s: float) -> bool:
    """A TTFT prediction of `raw_s` seconds (uncalibrated, from now) of which `raw_queue_s` are
    queue waits counts as waiting in no queue when the waits are at most a tenth of it."""
    return raw_queue_s <= 0.1 * raw_s


@dataclass
class _LogRatio:
    value: float = 0.0   # the fast average at `at`
    base: float = 0.0    # the slow average
    at: float = 0.0
    samples: int = 0
    spread: float = 0.0  # slow average of the squared deviation of the no-queue samples from `base`
    no_queue_samples: int = 0  # how many samples moved `base` and `spread`


@dataclass
class Calibration:
    clock: Clock
    alpha: float = 0.3          # weight of the newest request in the fast average
    slow_alpha: float = 0.1     # ... in the slow one
    half_life_s: float = 3.0    # relaxation of the fast average toward the slow one without samples
    max_factor: float = 8.0
    share_alpha: float = 0.05   # weight of the newest admission decision in the refused share
    overload_share: float = 0.1  # refused share from which every request takes the fast factor
    max_margin: float = 1.5     # bound of the miss margin (the scatter of the no-queue samples)
    margin_samples: int = 20    # no-queue samples before a margin is given
    _refusing: float = 0.0
    _ttft: _LogRatio = field(default_factory=_LogRatio)
    _tpot: _LogRatio = field(default_factory=_LogRatio)

    def __post_init__(self) -> None:
        if not (0.0 < self.alpha <= 1.0 and 0.0 < self.slow_alpha <= 1.0):
            raise ValueError(f"calibration alpha and slow_alpha must be in (0, 1], got {self.alpha}, {self.slow_alpha}")
        if self.half_life_s <= 0.0 or self.max_factor < 1.0:
            raise ValueError("calibration half_life_s must be > 0 and max_factor >= 1")
        if self.max_margin < 1.0 or self.margin_samples < 1:
            raise ValueError(f"calibration max_margin must be >= 1 (1: no margin) and margin_samples >= 1, got "
                             f"{self.max_margin}, {self.margin_samples}")
        if not (0.0 < self.share_alpha <= 1.0 and 0.0 < self.overload_share <= 1.0):
            raise ValueError(f"calibration share_alpha and overload_share must be in (0, 1], got "
                             f"{self.share_alpha}, {self.overload_share}")

    def ttft_factor(self, uncongested: bool = False) -> float:
        """The factor of a TTFT prediction; `uncongested`: the request is predicted to wait in no
        queue (see the module docstring)."""
        return self._factor(self._ttft, uncongested)

    def tpot_factor(self, uncongested: bool = False) -> float:
        return self._factor(self._tpot, uncongested)

    def ttft_margin(self) -> float:
        """How far over its TTFT limit a prediction may be before admission calls it a miss (see
        the module docstring): exp(the scatter of the no-queue samples) while admission refuses
        under `overload_share`, else 1."""
        return self._margin(self._ttft)

    def tpot_margin(self) -> float:
        return self._margin(self._tpot)

    def observe_ttft(self, raw_predicted_s: float, actual_s: float, raw_queue_s: float = 0.0,
                     probe: bool = False) -> None:
        """One request's first token: its uncalibrated prediction, what it got, and the queue
        wait the raw prediction counted in; `probe`: admission's probe."""
        self._observe(self._ttft, raw_predicted_s, actual_s, waits_in_no_queue(raw_queue_s, raw_predicted_s), probe)

    def observe_tpot(self, raw_predicted_s: float, actual_s: float, uncongested: bool = True,
                     probe: bool = False) -> None:
        self._observe(self._tpot, raw_predicted_s, actual_s, uncongested, probe)

    def admitted(self) -> None:
        """Admission let a request in (the refused share, see the module docstring)."""
        self._refusing -= self.share_alpha * self._refusing

    def refused(self, by_correction: bool = True) -> None:
        """A request was refused (the refused share). `by_correction`: only the TTFT correction
        refused it (its raw prediction fit); then its shadow sample, its raw prediction x the
        lasting bias, pulls the fast average by `alpha`."""
        self._refusing += self.share_alpha * (1.0 - self._refusing)
        r = self._ttft
        if by_correction and r.samples:
            current = self._relaxed(r)
            r.value, r.at = current + self.alpha * (r.base - current), self.clock.now()

    # ---------------------------------------------------------------------------------------------
    def _relaxed(self, r: _LogRatio) -> float:
        if r.samples == 0:
            return 0.0
        return r.base + (r.value - r.base) * 0.5 ** (max(0.0, self.clock.now() - r.at) / self.half_life_s)

    def _factor(self, r: _LogRatio, uncongested: bool = False) -> float:
        bound = math.log(self.max_factor)
        log = min(self._relaxed(r), r.base) if uncongested and self._calm() and r.samples else self._relaxed(r)
        return math.exp(min(bound, max(-bound, log)))

    def _calm(self) -> bool:
        """Admission refuses under `overload_share` of its recent decisions."""
        return self._refusing < self.overload_share

    def _margin(self, r: _LogRatio) -> float:
        if not self._calm() or r.no_queue_samples < self.margin_samples:
            return 1.0
        return min(self.max_margin, math.exp(math.sqrt(r.spread)))

    def _observe(self, r: _LogRatio, raw_predicted_s: float, actual_s: float, uncongested: bool,
                 probe: bool = False) -> None:
        if raw_predicted_s <= 0.0 or actual_s <= 0.0:
            return
        sample = math.log(actual_s / raw_predicted_s)
        current = self._relaxed(r)
        r.value = sample if r.samples == 0 or probe else current + self.alpha * (sample - current)
        if uncongested:
            if r.no_queue_samples:
                r.spread += self.slow_alpha * ((sample - r.base) ** 2 - r.spread)
            r.base += self.slow_alpha * (sample - r.base)
            r.no_queue_samples += 1
        r.at, r.samples = self.clock.now(), r.samples + 1
