"""The daemon's local HTTP control endpoint: ``GET /status`` (what `peerd status` prints).

It reads the daemon only through a snapshot callable, never its internals, and binds to loopback unless
``control.expose`` says otherwise (checked in the config).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from peerd.config import ControlConfig
from peerd.errors import ControlError

logger = logging.getLogger(__name__)

StatusProvider = Callable[[], Awaitable[dict[str, Any]]]


class ControlServer:
    def __init__(self, runner: web.AppRunner, url: str) -> None:
        self._runner = runner
        self.url = url

    @classmethod
    async def create(cls, config: ControlConfig, status: StatusProvider) -> ControlServer:
        async def handle_status(_: web.Request) -> web.Response:
            return web.json_response(await status())

        app = web.Application()
        app.router.add_get("/status", handle_status)
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
