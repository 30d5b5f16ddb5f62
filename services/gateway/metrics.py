"""The gateway's Prometheus metrics."""
from __future__ import annotations

from easerve.metrics import Registry


class GatewayMetrics:
    def __init__(self, registry: Registry | None = None):
        r = self.registry = registry or Registry()
        self.requests_running = r.gauge("requests_running", "Requests in flight at the gateway")
        self.requests_waiting = r.gauge("requests_waiting", "Requests accepted that have no first token yet")
        self.requests = r.counter("requests_total", "Requests by API and outcome code", ["api", "code"])
        self.finished = r.counter("requests_finished_total", "Finished requests by finish reason", ["reason"])
        self.ttft = r.histogram("time_to_first_token_seconds", "Gateway receipt to first token out")
        self.tpot = r.histogram("time_per_output_token_seconds", "(last - first token time) / (tokens - 1)")
        self.e2e = r.histogram("e2e_request_latency_seconds", "Gateway receipt to last token")
        self.stage_latency = r.histogram("stage_latency_seconds",
                                         "Per-stage time of a request (encode, prefill, queue, transfers)",
                                         ["stage"])
        self.prompt_tokens = r.counter("prompt_tokens_total", "Prompt tokens processed")
        self.generation_tokens = r.counter("generation_tokens_total", "Tokens generated")

    def render(self) -> str:
        return self.registry.render()
