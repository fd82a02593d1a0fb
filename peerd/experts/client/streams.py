"""Reusable libp2p streams for expert calls.

Opening a stream through p2pd costs two unix-socket connections and a protocol negotiation, about as much
as a whole small call; a MoE layer makes several calls per pass to the same hosts. So a call borrows an idle
stream to the host when there is one and gives it back after a clean exchange; the host serves calls on a
stream one after the other until the caller closes it. A stream that saw any error is closed, never reused,
and a call that finds its borrowed stream broken before any answer retries once on a fresh one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from peerd.experts.calls import IDLE_SECONDS
from peerd.wire.guard import StreamGuard

__all__ = ["PooledStream", "StreamPool"]

MAX_IDLE_PER_PEER = 16


@dataclass
class PooledStream:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reused: bool
    idle_since: float = 0.0


class StreamPool:
    def __init__(self, guard: StreamGuard, handler: str) -> None:
        self.guard = guard
        self.handler = handler
        self._idle: dict[str, list[PooledStream]] = {}

    async def acquire(self, peer: str, fresh: bool = False) -> PooledStream:
        idle = self._idle.get(peer, [])
        while idle and not fresh:
            stream = idle.pop()
            if time.monotonic() - stream.idle_since < IDLE_SECONDS and not stream.writer.is_closing():
                stream.reused = True
                return stream
            stream.writer.close()
        reader, writer = await self.guard.open(peer, self.handler)  # the membership handshake, once per stream
        return PooledStream(reader, writer, reused=False)

    def release(self, peer: str, stream: PooledStream) -> None:
        idle = self._idle.setdefault(peer, [])
        if len(idle) >= MAX_IDLE_PER_PEER or stream.writer.is_closing():
            stream.writer.close()
            return
        stream.idle_since = time.monotonic()
        idle.append(stream)

    def forget(self, peer: str) -> None:
        """Closes every idle stream to ``peer`` (it failed: they are likely broken too)."""
        for stream in self._idle.pop(peer, []):
            stream.writer.close()

    def close(self) -> None:
        for peer in list(self._idle):
            self.forget(peer)
