"""A stage's own HTTP endpoint: GET /metrics (Prometheus) and any extra JSON routes."""
from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from easerve.stages.common.metrics import CONTENT_TYPE, render


async def start_metrics_server(addr: str, registry, json_routes: dict[str, Callable[[web.Request], object]] | None = None,
                               before_scrape: Callable[[], None] | None = None):
    """Serve `registry` at http://addr/metrics; returns the runner (await runner.cleanup()),
    or None when `addr` is empty. `before_scrape()` refreshes gauges read on demand."""
    if not addr:
        return None
    app = web.Application()

    async def metrics(_req: web.Request) -> web.Response:
        if before_scrape is not None:
            before_scrape()
        return web.Response(body=render(registry), headers={"Content-Type": CONTENT_TYPE})

    app.router.add_get("/metrics", metrics)
    for path, fn in (json_routes or {}).items():
        app.router.add_get(path, _json_handler(fn))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    host, _, port = addr.rpartition(":")
    await web.TCPSite(runner, host or "127.0.0.1", int(port)).start()
    return runner


def _json_handler(fn):
    async def handler(req: web.Request) -> web.Response:
        try:
            return web.json_response(fn(req))
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
    return handler
