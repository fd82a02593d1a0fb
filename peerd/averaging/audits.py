"""Audits of spans that passed their checks, run after their round.

A member draws an audit of a span it applies (``verification.audit_probability``, or rows alike:
verify/checks.py): it asks the reducer for one chunk's rows and recomputes the average exactly, which catches a
reducer and a member lying together. The verdict is settled before the audit starts, so nothing the round
applies waits for it: the round returns, and the audit goes on over the span's stream, still open, accusing only
on evidence whenever it ends. A reducer that stalls its answer is suspected after the challenge's timeout; at
most ``MAX_AUDITS`` run at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from peerd.averaging.sender import SpanExchange

__all__ = ["MAX_AUDITS", "Audits"]

logger = logging.getLogger(__name__)

MAX_AUDITS = 16


class Audits:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        # the bytes (sent, received) of each audit, which ends after its round's report is returned
        self.on_bytes: Callable[[int, int], None] | None = None

    def start(self, exchange: SpanExchange) -> None:
        """Audits ``exchange``'s span (its ``audit_stream`` is open) in the background."""
        assert exchange.audit_stream is not None
        if len(self._tasks) >= MAX_AUDITS:
            logger.warning("Round %s: %d audits still running; not auditing span %d", exchange.group.round_id,
                           len(self._tasks), exchange.index)
            exchange.audit_stream[1].close()
            return
        task = asyncio.ensure_future(self._run(exchange))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, exchange: SpanExchange) -> None:
        sent, received = await exchange.audit()
        if self.on_bytes is not None:
            self.on_bytes(sent, received)

    async def wait(self) -> None:
        """Until every audit running now has ended."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.wait()
