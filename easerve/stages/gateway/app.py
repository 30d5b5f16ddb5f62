"""The gateway process: its parts built from its config, and `main(cfg)` that serves them.

Entry point: python -m services.gateway --model DIR --encode H:P --prefill H:P --decode H:P"""
from __future__ import annotations

import asyncio
import logging
import sys

from aiohttp import web

from easerve.media import FetchConfig, MediaFetcher, MediaLimits, MediaResolver, config_for
from easerve.media.pool import DecodePool
from easerve.models.loader import load_adapter
from easerve.rpc.server import ServerOptions, serve
from easerve.stages.common.cli import write_port_file
from easerve.stages.common.configs import GatewayConfig
from easerve.stages.common.loop_lag import watch_lag
from easerve.wire.v1 import gateway_pb2_grpc
from easerve.stages.gateway.auth import ApiKeys, GrpcAuth, http_middleware, warn_if_open
from easerve.stages.gateway.core import GatewayCore
from easerve.stages.gateway.http_api import HttpApi
from easerve.stages.gateway.metrics import GatewayMetrics
from easerve.stages.gateway.servicer import GatewayServicer

log = logging.getLogger("easerve.gateway")
# the GIL hand-over interval: preprocessing threads yield to the event loop within 1 ms (Python's
# default 5 ms, paid at each of the loop's GIL acquisitions, delays /health and token streaming)
LOOP_SWITCH_S = 0.001


def media_resolver(cfg: GatewayConfig, adapter) -> MediaResolver:
    fetch = FetchConfig(allowed_domains=cfg.allowed_media_domains,
                        allowed_local_path=cfg.allowed_local_media_path or None,
                        max_bytes=int(cfg.media_max_mb * (1 << 20)), timeout_s=cfg.media_timeout_s)
    limits = MediaLimits(max_request_pixels=int(cfg.media_max_mpixels * 1e6))
    return MediaResolver(config_for(adapter, limits), MediaFetcher(fetch), DecodePool(cfg.media_workers, cfg.media_queue))


async def main(cfg: GatewayConfig) -> None:
    keys, opts = ApiKeys.of(cfg), ServerOptions.of(cfg)
    sys.setswitchinterval(LOOP_SWITCH_S)
    warn_if_open(cfg, keys)
    adapter = load_adapter(cfg.model, role="processor", device="cpu")
    core = GatewayCore(cfg, adapter, GatewayMetrics(), media=media_resolver(cfg, adapter))
    await asyncio.to_thread(core.media.pool.start)
    core.start()
    ready = asyncio.Event()
    http = HttpApi(core, int(cfg.max_body_mb * (1 << 20)), ready.is_set,
                   middlewares=[http_middleware(keys)] if keys.enabled else [])
    runner = web.AppRunner(http.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    host, _, port = cfg.http_listen.rpartition(":")
    site = web.TCPSite(runner, host, int(port), ssl_context=opts.tls.server_ssl_context() if opts.tls.serving else None)
    await site.start()
    write_port_file(cfg.http_port_file, site._server.sockets[0].getsockname()[1])

    async def warmup() -> None:
        await core.warm()
        ready.set()

    stop = asyncio.Event()  # set on SIGTERM / SIGINT by serve(): the HTTP side refuses new work at once
    http_drain = asyncio.ensure_future(_drain_on(stop, http))
    lag = asyncio.ensure_future(watch_lag(core.m.loop_lag))

    async def settle() -> None:  # the drain also waits for the HTTP requests in flight (new ones get 503)
        while core.limit.inflight:
            await asyncio.sleep(0.05)
    try:
        await serve([(gateway_pb2_grpc.add_GatewayServicer_to_server, GatewayServicer(core))], cfg.listen,
                    health_services=["easerve.v1.Gateway"], warmup=warmup, options=opts,
                    interceptors=[GrpcAuth(keys)] if keys.enabled else [],
                    on_bound=lambda p: write_port_file(cfg.port_file, p), stop=stop, settle=settle)
    finally:
        http_drain.cancel()
        lag.cancel()
        http.drain()
        ready.clear()
        await runner.cleanup()
        await core.stop()
        core.media.pool.close()


async def _drain_on(stop: asyncio.Event, http: HttpApi) -> None:
    await stop.wait()
    log.info("draining: new HTTP requests get 503, in-flight ones finish")
    http.drain()

