"""The encode stage's control-plane metrics (Prometheus) and utilization trace."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from easerve.policy.clock import Clock, MonotonicClock
from easerve.stages.encode.trace import UtilizationTrace
from easerve.stages.common.metrics import LATENCY_BUCKETS, SIZE_BUCKETS, BytesByTransport, new_registry

SHARE_BUCKETS = (0.2, 0.4, 0.5, 0.6, 0.8, 1.0)  # 0.5: the static split


class EncodeMetrics:
    def __init__(self, target_remote_fraction: float, registry=None, clock: Clock | None = None):
        """`clock`: the one the trace's spans are timed with (refresh() reads it)."""
        r = self.registry = registry or new_registry()
        self.clock = clock or MonotonicClock()
        self.batch_size = Histogram("easerve:encode_batch_size", "Requests per encode micro-batch",
                                    buckets=SIZE_BUCKETS, registry=r)
        self.dispatches = Counter("easerve:encode_dispatch", "Micro-batch dispatches by reason", ["reason"],
                                  registry=r)
        self.queue_wait = Histogram("easerve:encode_queue_wait_seconds", "Time a request waited for its batch",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.encode_time = Histogram("easerve:encode_batch_seconds", "Encode time of one micro-batch",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.share = Histogram("easerve:encode_sm_share", "Compute share given to encode per batch",
                               buckets=SHARE_BUCKETS, registry=r)
        self.routed = Counter("easerve:encode_routed", "Requests routed after encode", ["route"], registry=r)
        self.remote_fraction = Gauge("easerve:encode_remote_fraction", "Achieved fraction of requests sent remote",
                                     registry=r)
        Gauge("easerve:encode_remote_fraction_target", "Target remote fraction s",
              registry=r).set(target_remote_fraction)
        self.utilization = Gauge("easerve:stage_utilization", "Busy fraction over the last 10 s", ["worker"],
                                 registry=r)
        self.partition = Gauge("easerve:encode_sm_partition", "The live SM backend and partition policy (1)",
                               ["backend", "policy"], registry=r)
        self.degraded = Gauge("easerve:encode_sm_partition_degraded",
                              "1 when the SM backend partitions less than asked (see /partition 'degraded')",
                              registry=r)
        self.trace = UtilizationTrace()
        self.busy_s = {"encode": 0.0, "prefill": 0.0}  # cumulative busy seconds of finished batches
        self._encoding_since: float | None = None        # start of the encode batch running now
        self._routes = {"local": 0, "remote": 0}

    def on_batch(self, dispatch, n_requests: int, start: float, end: float, share: float = 1.0) -> None:
        self.batch_size.observe(n_requests)
        self.dispatches.labels(reason=dispatch.reason).inc()
        self.encode_time.observe(end - start)
        self.share.observe(share)
        self.trace.record("encode", start, end, share, n_requests)
        self.busy_s["encode"] += end - start
        self._encoding_since = None

    def on_batch_start(self, start: float) -> None:
        self._encoding_since = start

    def on_batch_failed(self, start: float, end: float) -> None:
        self.busy_s["encode"] += end - start
        self._encoding_since = None

    def encode_busy_at(self, now: float) -> float:
        """Encode busy seconds up to `now`, the running batch's so far included (the online
        controller's input: a batch longer than its window still counts while it runs)."""
        running = 0.0 if self._encoding_since is None else max(0.0, now - self._encoding_since)
        return self.busy_s["encode"] + running

    def on_partition(self, backend: str, policy: str, degraded: str) -> None:
        self.partition.labels(backend=backend, policy=policy).set(1)
        self.degraded.set(1 if degraded else 0)

    def on_embed_senders(self, senders) -> None:
        """Export the bytes `senders` (a transport.handoff.KVSenders) handed to remote prefill,
        and those it still holds."""
        BytesByTransport(self.registry, "easerve:embed_sent_bytes", "Embedding tensor bytes handed to remote "
                         "prefill, by transport (inline: carried inside the gRPC message)", lambda: senders.sent_bytes)
        Gauge("easerve:embed_sender_held_bytes", "Embedding bytes held for remote prefill instances that have not "
              "let go of them yet (shm slab regions, one-off segments)",
              registry=self.registry).set_function(lambda: senders.held_bytes)

    def on_queue_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def on_prefill(self, start: float, end: float, share: float) -> None:
        self.trace.record("prefill", start, end, share)
        self.busy_s["prefill"] += end - start

    def on_route(self, route: str) -> None:
        self.routed.labels(route=route).inc()
        self._routes[route] += 1
        self.remote_fraction.set(self._routes["remote"] / sum(self._routes.values()))

    def refresh(self) -> None:
        """Before a scrape: utilization over the last 10 s."""
        now = self.clock.now()
        for kind in ("encode", "prefill"):
            self.utilization.labels(worker=kind).set(self.trace.utilization(kind, now - 10.0, now))


class CacheMetrics:
    """The encoder cache's counters (easerve.cache.embeddings), on the encode registry."""

    def __init__(self, registry):
        r = registry
        self.hits = Counter("easerve:encoder_cache_hits", "Media items answered from the encoder cache",
                            registry=r)
        self.joins = Counter("easerve:encoder_cache_joins",
                             "Media items that waited for the same media being encoded by another request",
                             registry=r)
        self.misses = Counter("easerve:encoder_cache_misses", "Media items not held (encoded, then held)",
                              registry=r)
        self.evictions = Counter("easerve:encoder_cache_evictions", "Embeddings dropped to fit the byte bound",
                                 registry=r)
        self.tower_items = Counter("easerve:encoder_cache_tower_items",
                                   "Media items the cache sent through the encoder tower", registry=r)
        self.pixel_free = Counter("easerve:encoder_cache_pixel_free_items",
                                  "Held media items that came without inputs (the gateway's probe found them)",
                                  registry=r)
        self.bytes = Gauge("easerve:encoder_cache_bytes", "Bytes of embeddings held", registry=r)
        self.entries = Gauge("easerve:encoder_cache_entries", "Embeddings held", registry=r)
        self.capacity = Gauge("easerve:encoder_cache_capacity_bytes", "The cache's byte bound (--encoder-cache-gb)",
                              registry=r)
