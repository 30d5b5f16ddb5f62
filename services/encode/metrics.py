"""The encode stage's control-plane metrics (Prometheus) and utilization trace."""
from __future__ import annotations

import time

from easerve.control.trace import UtilizationTrace
from easerve.metrics import SIZE_BUCKETS, Registry

SHARE_BUCKETS = (0.2, 0.4, 0.6, 0.8, 1.0)


class EncodeMetrics:
    def __init__(self, target_remote_fraction: float, registry: Registry | None = None):
        r = self.registry = registry or Registry()
        self.batch_size = r.histogram("encode_batch_size", "Requests per encode micro-batch", buckets=SIZE_BUCKETS)
        self.dispatches = r.counter("encode_dispatch_total", "Micro-batch dispatches by reason", ["reason"])
        self.queue_wait = r.histogram("encode_queue_wait_seconds", "Time a request waited for its batch")
        self.encode_time = r.histogram("encode_batch_seconds", "Encode time of one micro-batch")
        self.share = r.histogram("encode_sm_share", "Compute share given to encode per batch", buckets=SHARE_BUCKETS)
        self.routed = r.counter("encode_routed_total", "Requests routed after encode", ["route"])
        self.remote_fraction = r.gauge("encode_remote_fraction", "Achieved fraction of requests sent remote")
        self.remote_target = r.gauge("encode_remote_fraction_target", "Target remote fraction s")
        self.remote_target.set(target_remote_fraction)
        self.utilization = r.gauge("stage_utilization", "Busy fraction over the last 10 s", ["worker"])
        self.trace = UtilizationTrace()
        r.on_collect(self._refresh_utilization)

    def on_batch(self, dispatch, n_requests: int, start: float, end: float, share: float = 1.0) -> None:
        self.batch_size.observe(n_requests)
        self.dispatches.inc(reason=dispatch.reason)
        self.encode_time.observe(end - start)
        self.share.observe(share)
        self.trace.record("encode", start, end, share, n_requests)

    def on_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def on_prefill(self, start: float, end: float, share: float) -> None:
        self.trace.record("prefill", start, end, share)

    def on_route(self, route: str, router) -> None:
        self.routed.inc(route=route)
        total = self.routed.value(route="remote") + self.routed.value(route="local")
        self.remote_fraction.set(self.routed.value(route="remote") / total)

    def _refresh_utilization(self) -> None:
        now = time.monotonic()
        for kind in ("encode", "prefill"):
            self.utilization.set(self.trace.utilization(kind, now - 10.0, now), worker=kind)
