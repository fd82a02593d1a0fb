"""The daemon's local HTTP control endpoint.

- ``GET /status``: JSON snapshot of this peer and the swarm (what `peerd status` prints).
- ``GET /history?points=N``: the training curves (per-step loss, validation loss) and the last rounds.
- ``GET /metrics``: the same snapshot in Prometheus text format (see :mod:`peerd.metrics`).
- ``GET /``: the status page, self-contained static files from ``peerd/control/static/`` that poll the
  two JSON endpoints; its Content-Security-Policy forbids fetching anything from another origin.

It reads the daemon only through snapshot callables, never its internals, and binds to loopback unless
``control.expose`` says otherwise (checked in the config).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from peerd.config import ControlConfig
from peerd.errors import ControlError
from peerd.metrics import CONTENT_TYPE, DaemonMetrics

logger = logging.getLogger(__name__)

StatusProvider = Callable[[], Awaitable[dict[str, Any]]]
HistoryProvider = Callable[[int], dict[str, Any] | None]

STATIC_DIR = Path(__file__).with_name("static")
MAX_HISTORY_POINTS = 1000
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


def _finite(data: Any) -> Any:
    """NaN/Inf become null: json.dumps would write them as bare NaN, which browsers' JSON.parse rejects."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(value) for value in data]
    return data


def _json(data: Any) -> web.Response:
    return web.Response(text=json.dumps(_finite(data)), content_type="application/json")


def _history_points(request: web.Request) -> int:
    raw = request.query.get("points", str(MAX_HISTORY_POINTS))
    try:
        points = int(raw)
    except ValueError:
        points = 0
    if not 1 <= points <= MAX_HISTORY_POINTS:
        raise web.HTTPBadRequest(text=f"points must be an integer from 1 to {MAX_HISTORY_POINTS}, "
                                 f"got {raw!r}")
    return points


class ControlServer:
    def __init__(self, runner: web.AppRunner, url: str) -> None:
        self._runner = runner
        self.url = url

    @classmethod
    async def create(
        cls,
        config: ControlConfig,
        status: StatusProvider,
        history: HistoryProvider | None = None,
        metrics: DaemonMetrics | None = None,
    ) -> ControlServer:
        """``history`` returns ``TrainingReport.history(points)`` (None when not training); ``metrics`` is
        this daemon's registry (a fresh one by default)."""
        registry = metrics if metrics is not None else DaemonMetrics()

        async def handle_status(_: web.Request) -> web.Response:
            return _json(await status())

        async def handle_history(request: web.Request) -> web.Response:
            points = _history_points(request)
            return _json({"training": history(points) if history is not None else None})

        async def handle_metrics(_: web.Request) -> web.Response:
            body = registry.render(await status())
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

        async def handle_page(_: web.Request) -> web.FileResponse:
            return web.FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)

        app = web.Application()
        app.router.add_get("/status", handle_status)
        app.router.add_get("/history", handle_history)
        app.router.add_get("/metrics", handle_metrics)
        app.router.add_get("/", handle_page)
        app.router.add_static("/static/", STATIC_DIR, show_index=False, follow_symlinks=False)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            raise ControlError(
                f"cannot bind the control endpoint to {config.host}:{config.port} ({e.strerror or e}); another "
                "daemon probably uses it: set control.port (e.g. --control-port 0 for a free one)",
                field="control.port",
            ) from e
        host, port = runner.addresses[0][:2]
        return cls(runner, f"http://{host}:{port}")

    async def shutdown(self) -> None:
        await self._runner.cleanup()
