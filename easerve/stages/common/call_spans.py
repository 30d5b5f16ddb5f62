"""A stage's call spans: one record per prefill batch or decode step it ran (kind, start, end in
seconds of `time.monotonic`, batch size, and the size that sets its cost: `tokens`, the batch's
prompt tokens, for prefill; `context`, the mean tokens each row attends to, for decode), bounded,
served as GET /trace on the stage's metrics endpoint in the shape of the encode service's spans:
{"now": t, "spans": [{"kind", "start", "end", "batch", "tokens" | "context"}, ...]} (the latest 500
of the last `?window_s=` seconds, 60 by default). The fidelity replay (bench/fidelity_replay.py)
sets each against the profile's prediction for that batch."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

LAST = 500  # spans one GET /trace returns at most (the encode service's bound too)


class CallSpans:
    def __init__(self, maxlen: int = 5000, clock: Callable[[], float] = time.monotonic) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1, got {maxlen}")
        self._spans: deque[dict] = deque(maxlen=maxlen)
        self.clock = clock

    def record(self, kind: str, start: float, end: float, batch: int, **size: int) -> None:
        if end < start:
            raise ValueError(f"a call span cannot end ({end}) before it starts ({start})")
        self._spans.append({"kind": kind, "start": start, "end": end, "batch": int(batch),
                            **{k: int(v) for k, v in size.items()}})

    def spans(self, since: float = float("-inf")) -> list[dict]:
        return [dict(s) for s in self._spans if s["end"] >= since]

    def trace(self, window_s: float = 60.0) -> dict:
        now = self.clock()
        return {"now": now, "spans": self.spans(now - window_s)[-LAST:]}

    def http(self, req) -> dict:
        """The GET /trace handler (easerve.stages.common.metrics_http json route)."""
        return self.trace(float(req.query.get("window_s", "60")))
