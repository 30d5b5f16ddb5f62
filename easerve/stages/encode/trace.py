"""Utilization trace: busy intervals of the encode worker and the co-located prefill,
the data behind the paper's utilization figure. Pure bookkeeping, clock-free (callers
pass times), bounded memory."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Busy:
    kind: str        # "encode" | "prefill"
    start: float     # seconds (of the encode process's clock)
    end: float
    share: float     # compute share the work ran with (1.0 = whole device)
    batch: int = 1


class UtilizationTrace:
    def __init__(self, maxlen: int = 20000):
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self._spans: deque[Busy] = deque(maxlen=maxlen)

    def record(self, kind: str, start: float, end: float, share: float = 1.0, batch: int = 1) -> None:
        if end < start:
            raise ValueError(f"a busy span cannot end ({end}) before it starts ({start})")
        self._spans.append(Busy(kind, start, end, share, batch))

    def spans(self, since: float = float("-inf")) -> list[Busy]:
        return [s for s in self._spans if s.end >= since]

    def utilization(self, kind: str, start: float, end: float, weighted: bool = True) -> float:
        """Fraction of [start, end] the `kind` worker was busy (share-weighted if asked)."""
        if end <= start:
            raise ValueError("the window must have end > start")
        busy = 0.0
        for s in self._spans:
            if s.kind != kind:
                continue
            overlap = min(end, s.end) - max(start, s.start)
            if overlap > 0:
                busy += overlap * (s.share if weighted else 1.0)
        return min(1.0, busy / (end - start))

    def buckets(self, start: float, end: float, width: float) -> list[dict]:
        """Per-interval utilization of each kind: a time series to plot."""
        if width <= 0:
            raise ValueError("bucket width must be > 0")
        out, t = [], start
        kinds = sorted({s.kind for s in self._spans})
        while t < end:
            hi = min(end, t + width)
            out.append({"t": t, **{k: round(self.utilization(k, t, hi), 6) for k in kinds}})
            t = hi
        return out
