"""How fast a stage has actually been running: a moving average of its recent batches (or
decode steps), served in `Stage/Load` (`recent_batch_s`, `recent_batch_size`).

The profile says how long a batch takes on an idle device; a live instance may run slower
(neighbours on the same cores or GPU, fewer threads than the profile had). The gateway's
latency predictor divides the recent batch time by the profile's time for a batch of the
recent size and scales that instance's queue and service times by the ratio
(easerve/policy/latency.py, "Pace").

A pace is forgotten `ttl_s` after the last batch: an idle stage's neighbours may be idle too,
and a caller that refused work on a stale slow pace would never see a batch that corrects it."""
from __future__ import annotations

from dataclasses import dataclass, field

from easerve.policy.clock import Clock, MonotonicClock


@dataclass
class Pace:
    """Exponential moving averages of batch seconds and batch size (`alpha`: the weight of
    the newest batch). `now()` gives (0, 0) before the first batch and once the last one
    is over `ttl_s` old; the next batch then starts the averages afresh."""
    alpha: float = 0.3
    ttl_s: float = 5.0
    clock: Clock = field(default_factory=MonotonicClock)
    batch_s: float = 0.0
    batch_size: float = 0.0
    last_at: float = float("-inf")

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"Pace alpha must be in (0, 1], got {self.alpha}")
        if self.ttl_s <= 0.0:
            raise ValueError(f"Pace ttl_s must be > 0, got {self.ttl_s}")

    def observe(self, seconds: float, size: float) -> None:
        """One batch of `size` (requests, tokens or running sequences, as the stage counts
        its batches) that took `seconds`, ending now."""
        if seconds < 0 or size <= 0:
            return
        if self.now() == (0.0, 0.0):
            self.batch_s, self.batch_size = seconds, float(size)
        else:
            a = self.alpha
            self.batch_s += a * (seconds - self.batch_s)
            self.batch_size += a * (size - self.batch_size)
        self.last_at = self.clock.now()

    def now(self) -> tuple[float, float]:
        """(batch seconds, batch size) as served; (0, 0) when unknown or stale."""
        if self.clock.now() - self.last_at > self.ttl_s:
            return 0.0, 0.0
        return self.batch_s, self.batch_size
