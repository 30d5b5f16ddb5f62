"""Prometheus metrics of the stages, through `prometheus_client`.

Each process builds one `CollectorRegistry` (no global state) and the metric groups of the
work it does: a prefill group wherever prefill runs (the prefill service, encode's
co-located prefill), a decode group in decode, encode's own in encode, the gateway's at the
gateway. Names follow vLLM's where one exists (`vllm:X` -> `easerve:X`), so dashboards
built for vLLM read ours with the prefix changed.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTENT_TYPE = CONTENT_TYPE_LATEST


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


class BytesByTransport:
    """A counter `name{transport}` read at scrape time from a transport's own byte counts
    (easerve.transport.handoff: KVSenders.sent_bytes, KVReceiver.received_bytes)."""

    def __init__(self, registry: CollectorRegistry, name: str, doc: str, counts: Callable[[], Mapping[str, int]]):
        self.name, self.doc, self._counts = name, doc, counts
        registry.register(self)

    def collect(self):
        family = CounterMetricFamily(self.name, self.doc, labels=["transport"])
        for transport, n in sorted(self._counts().items()):
            family.add_metric([transport], n)
        yield family


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry, queued: Callable[[], int] | None = None,
                 kv_held: Callable[[], int] | None = None, embed_received: Callable[[], Mapping[str, int]] | None = None):
        """`queued()`: requests waiting for a prefill batch; `kv_held()`: KV bytes the senders
        still hold for decode; `embed_received()`: embedding bytes taken in from encode, by
        transport (all read when scraped)."""
        r = registry
        self.busy_s = 0.0  # seconds of batched forwards so far (Load's busy_s)
        self.batch_size = Histogram("easerve:prefill_batch_size",
                                    "Size of the prefill batch each request ran in", buckets=SIZE_BUCKETS, registry=r)
        self.batch_time = Histogram("easerve:prefill_batch_seconds", "Time of one prefill forward",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.kv_transfer = Histogram("easerve:kv_transfer_seconds", "Prefill -> decode KV handoff",
                                     ["transport"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("easerve:prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.prefix_queries = Counter("easerve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("easerve:prefix_cache_hits", "Prompt tokens the prefix cache answered",
                                   registry=r)
        if queued is not None:
            Gauge("easerve:prefill_queue_depth", "Requests waiting for a prefill batch",
                  registry=r).set_function(queued)
        if kv_held is not None:
            Gauge("easerve:kv_sender_held_bytes", "KV bytes held for decode instances that have not let go "
                  "of them yet (shm slab regions, one-off segments)", registry=r).set_function(kv_held)
        if embed_received is not None:
            BytesByTransport(r, "easerve:embed_received_bytes", "Embedding tensor bytes taken in from encode, by "
                             "transport (inline: carried inside the gRPC message)", embed_received)

    def on_batch(self, start: float, end: float) -> None:
        self.batch_time.observe(end - start)
        self.busy_s += end - start

    def on_request(self, batch_size: int, prompt_tokens: int) -> None:
        self.batch_size.observe(batch_size)
        self.prompt_tokens.inc(prompt_tokens)

    def on_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries.inc(queried_tokens)
        self.prefix_hits.inc(hit_tokens)

    def on_kv_handoff(self, transport: str, seconds: float) -> None:
        self.kv_transfer.labels(transport=transport).observe(seconds)


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry, stats: Callable[[], object]):
        """`stats()`: the engine's latest EngineStats (read when scraped)."""
        r = registry
        self._stats = stats
        self.running = Gauge("easerve:num_requests_running", "Requests decoding", registry=r)
        self.waiting = Gauge("easerve:num_requests_waiting", "Requests waiting for KV room (and reservations)",
                             registry=r)
        self.kv_usage = Gauge("easerve:kv_cache_usage_perc", "Fraction of KV tokens in use", registry=r)
        self.batch_size = Histogram("easerve:decode_batch_size", "Requests per decode step",
                                    buckets=SIZE_BUCKETS, registry=r)
        self.step_time = Histogram("easerve:decode_step_seconds", "Time of one decode step",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.kv_receive = Histogram("easerve:kv_receive_seconds", "Time decode took to take a request's KV in",
                                    ["transport"], buckets=LATENCY_BUCKETS, registry=r)
        self.kv_receive_bytes = Counter("easerve:kv_receive_bytes", "KV tensor bytes decode took in",
                                        ["transport"], registry=r)
        self.generation_tokens = Counter("easerve:generation_tokens", "Tokens decoded", registry=r)
        self.finished = Counter("easerve:request_success", "Finished requests by reason", ["finished_reason"],
                                registry=r)

    def refresh(self) -> None:
        s = self._stats()
        if s is None:
            return
        self.running.set(s.running)
        self.waiting.set(s.waiting)
        self.kv_usage.set(s.kv_used_tokens / s.kv_capacity_tokens if s.kv_capacity_tokens else 0.0)

    def on_step(self, batch: int, seconds: float) -> None:
        if batch:
            self.batch_size.observe(batch)
            self.step_time.observe(seconds)
            self.generation_tokens.inc(batch)
