"""The gateway's Prometheus metrics (prometheus_client; vLLM's names under `easerve:`)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from easerve.stages.common.host_time import HostTime
from easerve.stages.common.loop_lag import LAG_BUCKETS
from easerve.stages.common.metrics import LATENCY_BUCKETS, new_registry, render

REL_ERROR_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _Labeled:
    """`metric.inc(code="200")` / `.observe(v, stage="encode")` on a labelled metric."""

    def __init__(self, metric):
        self.metric = metric

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.metric.labels(**labels).inc(amount)

    def observe(self, value: float, **labels: str) -> None:
        self.metric.labels(**labels).observe(value)


class GatewayMetrics:
    def __init__(self, registry=None):
        r = self.registry = registry or new_registry()
        self.loop_lag = Histogram("easerve:gateway_event_loop_lag_seconds",
                                  "How late the gateway's event loop woke a 10 ms ticker: the delay any request, "
                                  "token or /health call meets there (easerve.stages.common.loop_lag)",
                                  buckets=LAG_BUCKETS, registry=r)
        self.requests_running = Gauge("easerve:num_requests_running", "Requests in flight at the gateway",
                                      registry=r)
        self.requests_waiting = Gauge("easerve:num_requests_waiting",
                                      "Requests accepted that have no first token yet", registry=r)
        self.requests = _Labeled(Counter("easerve:requests", "Requests by API and outcome code",
                                         ["api", "code"], registry=r))
        self.finished = _Labeled(Counter("easerve:request_success", "Finished requests by finish reason",
                                         ["finished_reason"], registry=r))
        self.ttft = Histogram("easerve:time_to_first_token_seconds", "Gateway receipt to first token out",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("easerve:time_per_output_token_seconds",
                              "(last - first token time) / (tokens - 1)", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("easerve:e2e_request_latency_seconds", "Gateway receipt to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.stage_latency = _Labeled(Histogram("easerve:stage_latency_seconds",
                                                "Per-stage time of a request (encode, prefill, queue, transfers)",
                                                ["stage"], buckets=LATENCY_BUCKETS, registry=r))
        self.prompt_tokens = Counter("easerve:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("easerve:generation_tokens", "Tokens generated", registry=r)
        self.preprocess_skipped = Counter(
            "easerve:gateway_preprocess_skipped", "Requests whose media were neither decoded nor run through "
            "the HF processor (the encoder cache held every item)", registry=r)
        self.cache_late_misses = Counter(
            "easerve:gateway_encoder_cache_late_misses", "Requests sent to an encode instance without pixels "
            "that it no longer held; resent with every item's pixels (preprocessed in full)", registry=r)
        self.migrations = _Labeled(Counter(
            "easerve:migrations", "Requests moved mid-stream to another instance of a stage, by the reason "
            "(died: its stream failed; stalled: no token within --decode-progress-timeout-s)",
            ["stage", "reason"], registry=r))

        self.admissions = _Labeled(Counter(
            "easerve:admission_decisions", "SLO-aware admission decisions (admit, best_effort, reject) by tier "
            "and priority class", ["decision", "tier", "priority"], registry=r))
        self.predicted_ttft = Histogram("easerve:predicted_time_to_first_token_seconds",
                                        "TTFT the latency predictor gave each request at admission",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.ttft_prediction_error = Histogram(
            "easerve:ttft_prediction_relative_error", "|predicted - actual| / actual TTFT per request",
            buckets=REL_ERROR_BUCKETS, registry=r)
        self.host = HostTime(r, "gateway")

    def render(self) -> str:
        return render(self.registry).decode()
