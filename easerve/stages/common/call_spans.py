"""A stage's call spans: one record per prefill batch or decode step it ran (kind, start, end in
seconds of `time.monotonic`, batch size, and the size that sets its cost: `tokens`, the batch's
prompt tokens, for prefill; `context`, the mean tokens each row attends to, for decode), bounded,
served as GET /trace on the stage's metrics endpoint in the shape of the encode service's spans:
{"now": t, "spans": [{"kind", "start", "end", "batch", "tokens" | "context"}, ...]} (the latest
`?last=` spans, 500 by default, of the last `?window_s=` seconds, 60 by default; the record keeps
the latest 20,000: a minute of decode steps at 300 a second). The fidelity replay (bench/fidelity_replay.py)
sets each against the profile's prediction for that batch."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

LAST = 500  # spans one GET /trace returns unless ?last= asks for more (the encode service's default too)


def query_last(req) -> int:
    """GET /trace's `?last=N`: how many of the latest spans to return (LAST when not given)."""
    text = req.query.get("last", str(LAST))
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        from aiohttp import web
        raise web.HTTPBadRequest(text=f"last must be a whole number >= 1, got {text!r}")
    return n


class CallSpans:
    def __init__(self, maxlen: int = 20000, clock: Callable[[], float] = time.monotonic) -> None:
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

    def trace(self, window_s: float = 60.0, last: int = LAST) -> dict:
        now = self.clock()
        return {"now": now, "spans": self.spans(now - window_s)[-last:]}

    def http(self, req) -> dict:
        """The GET /trace handler (easerve.stages.common.metrics_http json route)."""
        return self.trace(float(req.query.get("window_s", "60")), query_last(req))
