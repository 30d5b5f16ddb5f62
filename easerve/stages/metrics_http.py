"""A stage's own Prometheus endpoint: GET /metrics (and any extra JSON routes)."""
from __future__ import annotations

from collections.abc import Callable

from aiohttp import web


async def start_metrics_server(addr: str, registry, json_routes: dict[str, Callable[[web.Request], object]] | None = None):
    """Serve `registry` at http://addr/metrics; returns the runner (await runner.cleanup())."""
    app = web.Application()

    async def metrics(_req: web.Request) -> web.Response:
        return web.Response(text=registry.render(), content_type="text/plain", charset="utf-8")

    app.router.add_get("/metrics", metrics)
    for path, fn in (json_routes or {}).items():
        app.router.add_get(path, _json_handler(fn))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = addr.rpartition(":")
    await web.TCPSite(runner, host or "0.0.0.0", int(port)).start()
    return runner


def _json_handler(fn):
    async def handler(req: web.Request) -> web.Response:
        try:
            return web.json_response(fn(req))
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
    return handler
