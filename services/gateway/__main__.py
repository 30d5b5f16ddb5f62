"""python -m services.gateway --model DIR --encode H:P --prefill H:P [--listen 0.0.0.0:50051 --http-listen 0.0.0.0:8000]"""
from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from aiohttp import web

from easerve.media import FetchConfig, MediaFetcher, MediaLimits, MediaResolver, config_for
from easerve.models.registry import load_adapter
from easerve.rpc.server import serve, run
from easerve.stages.cli import addrs, base_parser, setup_process, write_port_file
from easerve.v1 import gateway_pb2_grpc
from services.gateway.core import GatewayConfig, GatewayCore
from services.gateway.http_api import HttpApi
from services.gateway.metrics import GatewayMetrics
from services.gateway.servicer import GatewayServicer

log = logging.getLogger("easerve.gateway")


def parse(argv):
    p = base_parser("gateway", "0.0.0.0:50051")
    p.add_argument("--http-listen", default="0.0.0.0:8000", help="OpenAI-compatible HTTP address")
    p.add_argument("--encode", default="", help="encode workers, comma-separated host:port")
    p.add_argument("--prefill", required=True, help="prefill workers for text-only requests, comma-separated")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: folder name)")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--max-body-mb", type=float, default=64.0)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + max_tokens limit (default: the model's, capped at 4096 like decode's --max-seq-len)")
    p.add_argument("--max-inflight", type=int, default=1024, help="past this many requests: 429 / RESOURCE_EXHAUSTED")
    p.add_argument("--allowed-media-domains", default="",
                   help="comma-separated hosts media URLs may name (*.example.com for subdomains); empty: any "
                        "public host. Private / loopback addresses are refused unless their host is listed here")
    p.add_argument("--allowed-local-media-path", default=None, help="serve file:// media URLs from below this folder")
    p.add_argument("--media-max-mb", type=float, default=64.0, help="largest media file fetched by URL")
    p.add_argument("--media-timeout-s", type=float, default=10.0, help="time limit of one media URL fetch")
    p.add_argument("--media-max-mpixels", type=float, default=256.0,
                   help="decoded pixels per request (all images and video frames), in millions")
    p.add_argument("--port-file", default=None, help="write the bound gRPC port here")
    p.add_argument("--http-port-file", default=None, help="write the bound HTTP port here")
    return p.parse_args(argv)


def media_resolver(args, adapter) -> MediaResolver:
    fetch = FetchConfig(allowed_domains=tuple(args.allowed_media_domains.split(",")),
                        allowed_local_path=args.allowed_local_media_path,
                        max_bytes=int(args.media_max_mb * (1 << 20)), timeout_s=args.media_timeout_s)
    limits = MediaLimits(max_request_pixels=int(args.media_max_mpixels * 1e6))
    return MediaResolver(config_for(adapter, limits), MediaFetcher(fetch))


async def main(args) -> None:
    adapter = load_adapter(args.model, role="processor", device="cpu")
    cfg = GatewayConfig(served_model=args.served_model_name or Path(args.model).resolve().name,
                        encode_addrs=addrs(args.encode), prefill_addrs=addrs(args.prefill),
                        request_timeout_s=args.request_timeout_s, default_max_tokens=args.default_max_tokens,
                        max_inflight=args.max_inflight, max_model_len=args.max_model_len)
    core = GatewayCore(cfg, adapter, GatewayMetrics(), media=media_resolver(args, adapter))
    ready = asyncio.Event()
    http = HttpApi(core, int(args.max_body_mb * (1 << 20)), ready.is_set)
    runner = web.AppRunner(http.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    host, _, port = args.http_listen.rpartition(":")
    site = web.TCPSite(runner, host, int(port))
    await site.start()
    write_port_file(args.http_port_file, site._server.sockets[0].getsockname()[1])

    async def warmup() -> None:
        ready.set()

    try:
        await serve([(gateway_pb2_grpc.add_GatewayServicer_to_server, GatewayServicer(core))], args.listen,
                    health_services=["easerve.v1.Gateway"], warmup=warmup, grace_s=args.grace_s,
                    on_bound=lambda p: write_port_file(args.port_file, p))
    finally:
        ready.clear()
        await runner.cleanup()


if __name__ == "__main__":
    a = parse(sys.argv[1:])
    setup_process(a)
    run(main(a))
