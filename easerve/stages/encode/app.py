"""The encode process: its parts built from its config, and `main(cfg)` that serves them.

Entry point: python -m services.encode --model DIR (--prefill H:P | --colocate-prefill --decode H:P) [options]"""
from __future__ import annotations

import asyncio
import concurrent.futures

from easerve.policy.batcher import AdaptiveBatcher
from easerve.policy.clock import MonotonicClock
from easerve.policy.router import DeficitRouter
from easerve.stages.common.metrics import PrefillMetrics
from easerve.models.loader import load_adapter
from easerve.rpc.server import ServerOptions, serve
from easerve.stages.common import load as stage_load
from easerve.stages.common.call_spans import query_last
from easerve.stages.common.cli import dtype_of, write_port_file
from easerve.stages.common.configs import EncodeConfig
from easerve.stages.encode.loop import EncodeLoop
from easerve.stages.common.metrics_http import start_metrics_server
from easerve.stages.common.peers import peers_of
from easerve.stages.prefill.stage import build_prefill_stage
from easerve.stages.common.warmup import prefill_once
from easerve.transport.handoff import KVSenders
from easerve.transport.node import local_identity
from easerve.wire.v1 import encode_pb2_grpc, prefill_pb2_grpc
from easerve.cache.embeddings import EmbeddingCache, model_fingerprint
from easerve.cache.prefix_route import PrefixRoute
from easerve.stages.encode.colocate import build_controller
from easerve.stages.encode.profiler import synthetic_item
from easerve.stages.encode.metrics import CacheMetrics, EncodeMetrics
from easerve.stages.encode.servicer import EncodeServicer
from easerve.stages.encode.online import OnlineTask
from easerve.policy.online import Knobs


def _prefill_share(alloc) -> float:
    """What the co-located prefill runs with: its share, or the whole device when encode's
    allocation leaves it none (it then time-slices with encode, uncontrolled)."""
    return alloc.prefill_share if alloc is not None and alloc.prefill_share > 0 else 1.0


class Encoder:
    """The encode process's parts, built from its config."""

    def __init__(self, cfg: EncodeConfig):
        self.cfg = cfg
        self.opts = ServerOptions.of(cfg)
        self.node = local_identity(cfg.torch_device)
        dtype = dtype_of(cfg.dtype)
        self.adapter = load_adapter(cfg.model, role="encode", device=cfg.torch_device, dtype=dtype)
        self.clock = MonotonicClock()  # the loops', the trace's and /trace's time
        self.metrics = EncodeMetrics(cfg.remote_fraction, clock=self.clock)
        self.encode_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="encode")
        self.prefill_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="local-prefill")
        self.local_lm = load_adapter(cfg.model, role="prefill", device=cfg.torch_device, dtype=dtype) \
            if cfg.colocate_prefill else None
        self.controller = self._controller()
        if self.controller is not None:
            self.metrics.on_partition(self.controller.backend.name, self.controller.partitioner.policy,
                                      self.controller.backend.degraded)
        self.loop = EncodeLoop(self.adapter, AdaptiveBatcher(cfg.batcher), self.controller, self.metrics,
                               self.encode_pool, clock=self.clock)
        self.local = self._local_stage()
        self.call_spans = [self.local.loop.spans] if self.local is not None else []  # /trace's "calls"
        self.remote = peers_of(cfg, "prefill", prefill_pb2_grpc.PrefillStub, self.opts.channel_options(),
                               "easerve.v1.Prefill", tls=self.opts.tls)
        self.cache = self._cache()
        # embeddings to remote prefill: the KV transports, chosen per instance (no KVStream there)
        self.embed = KVSenders(self.node, self.remote.reach_of, cfg.embed_transport, self.opts.channel_options(),
                               tls=self.opts.tls, byte_stream=False)
        self.metrics.on_embed_senders(self.embed)
        self.servicer = EncodeServicer(self.loop, DeficitRouter(cfg.remote_fraction), self.local,
                                       self.remote, self.metrics, cfg.max_inflight, cache=self.cache,
                                       route=self._route(), embed=self.embed)
        self.online = self._online()
        self.servicer.online = self.online

    def _route(self) -> PrefixRoute | None:
        """Prefix-cache placement among the remote prefill instances (their cache is on unless
        this deployment turns it off: the same --no-prefix-cache / --prefix-block-tokens)."""
        if self.cfg.prefix_cache is None:
            return None
        return PrefixRoute(self.cfg.prefix_block_tokens, self.adapter.placeholder_ids)

    def _online(self) -> OnlineTask | None:
        c = self.cfg
        if not c.online:
            return None
        return OnlineTask(c.online_config, Knobs(c.max_batch, c.remote_fraction, c.partition_tolerance), self.clock,
                          batcher=self.loop.batcher, router=self.servicer.router, partition=self.controller,
                          metrics=self.metrics, remote=self.remote, queued=lambda: self.loop.queued,
                          registry=self.metrics.registry, instances_file=c.online_instances_file)

    def _cache(self) -> EmbeddingCache | None:
        if self.cfg.encoder_cache_gb == 0:
            return None
        fp = model_fingerprint(self.adapter.path, str(self.adapter.dtype), self.cfg.torch_device)
        return EmbeddingCache(int(self.cfg.encoder_cache_gb * 2**30), fp, CacheMetrics(self.metrics.registry))

    def _controller(self):
        if not self.cfg.colocate_prefill:
            return None  # encode alone on its device: nothing to share
        c = self.cfg
        return build_controller(self.adapter, c.torch_device, c.sm_backend, c.partitioner.policy,
                                c.partition_profile or None, c.batch_sizes, c.partitioner.tolerance,
                                self.encode_pool, self.prefill_pool, model=self.adapter.path)

    def _local_stage(self):
        if self.local_lm is None:
            return None
        share = lambda: _prefill_share(self.controller.last)  # noqa: E731

        def on_busy(t0: float, t1: float) -> None:
            self.metrics.on_prefill(t0, t1, share())
            self.prefill_metrics.on_batch(t0, t1)

        self.prefill_metrics = PrefillMetrics(self.metrics.registry, queued=lambda: self.local.loop.queued)
        return build_prefill_stage(self.cfg, self.local_lm, self.opts.channel_options(), self.node,
                                   executor=self.prefill_pool, scope=self.controller.prefill_scope,
                                   on_busy=on_busy, metrics=self.prefill_metrics, clock=self.clock)

    async def load(self) -> stage_load.Load:
        return stage_load.Load(self.servicer.limit.inflight, self.cfg.max_inflight, self.loop.queued,
                               pace=self.loop.pace, overdue=self.loop.overdue)

    def partition_info(self, _req=None) -> dict:
        if self.controller is None:
            return {"backend": None, "reason": "no co-located prefill: encode has the device alone"}
        return self.controller.describe()

    def trace(self, req) -> dict:
        window, last = float(req.query.get("window_s", "60")), query_last(req)
        now = self.clock.now()
        spans = [{"kind": b.kind, "start": b.start, "end": b.end, "share": b.share, "batch": b.batch}
                 for b in self.metrics.trace.spans(now - window)[-last:]]  # the latest `last`: the share each ran with
        calls = sorted((c for cs in self.call_spans for c in cs.spans(now - window)), key=lambda c: c["start"])
        return {"now": now, "buckets": self.metrics.trace.buckets(now - window, now, max(window / 120, 0.05)),
                "spans": spans, "calls": calls[-last:]}  # calls: the co-located prefill's batches (+ a monolith's steps)

    async def warmup(self) -> None:
        loop = asyncio.get_running_loop()  # one real encode (and local prefill) before SERVING
        await loop.run_in_executor(self.encode_pool, self.adapter.encode, [synthetic_item(self.adapter)])
        if self.local_lm is not None:
            await loop.run_in_executor(self.prefill_pool, prefill_once, self.local_lm)
            self.local.start()
        self.remote.start()
        self.loop.start()
        if self.online is not None:
            self.online.start()

    async def start_http(self):
        return await start_metrics_server(self.cfg.metrics_listen, self.metrics.registry,
                                          {"/trace": self.trace, "/partition": self.partition_info},
                                          before_scrape=self.metrics.refresh)

    async def stop(self) -> None:
        if self.online is not None:
            await self.online.stop()
        await self.loop.stop()
        await self.remote.close()
        await self.embed.close()
        if self.local is not None:
            await self.local.stop()

    def adders(self) -> list:
        return [(encode_pb2_grpc.add_EncodeServicer_to_server, self.servicer),
                stage_load.adder(stage_load.StageServicer("encode", self.node, self.load))]


async def main(cfg: EncodeConfig) -> None:
    enc = Encoder(cfg)
    runner = await enc.start_http()
    try:
        await serve(enc.adders(), cfg.listen, health_services=["easerve.v1.Encode"], warmup=enc.warmup,
                    options=enc.opts, on_bound=lambda p: write_port_file(cfg.port_file, p))
    finally:
        await enc.stop()
        if runner is not None:
            await runner.cleanup()

