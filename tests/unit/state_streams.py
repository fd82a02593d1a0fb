"""Test doubles for the state transfer: peers in one process whose streams are socket pairs (``LocalNet``, what
StreamGuard's add_handler/open do, minus p2pd and the handshake), and a guard wrapper whose streams from one
peer pause after a number of bytes until the test says so (``PausingGuard``): the hook a test uses to take a
donor away mid-transfer, on an event instead of a sleep."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import Any, cast

from peerd.wire.guard import Handler, StreamGuard

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class LocalNet:
    def __init__(self) -> None:
        self.handlers: dict[str, dict[str, Handler]] = {}
        self.served: dict[str, list[asyncio.StreamWriter]] = {}  # each peer's serving ends, to cut them
        self.tasks: set[asyncio.Task[None]] = set()
        self.opened: list[asyncio.StreamWriter] = []

    def guard(self, peer: str) -> StreamGuard:
        return cast(StreamGuard, _LocalGuard(self, peer))

    def cut(self, peer: str) -> None:
        """``peer`` disappears: its handlers go and every stream it serves breaks."""
        self.handlers.pop(peer, None)
        for writer in self.served.pop(peer, []):
            writer.transport.abort()

    async def idle(self) -> None:
        """Returns once every stream served so far has ended."""
        await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def close(self) -> None:
        for writer in self.opened:
            writer.close()
        for peer in list(self.served):
            self.cut(peer)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class _LocalGuard:
    def __init__(self, net: LocalNet, peer_id: str) -> None:
        self.net = net
        self.peer_id = peer_id

    async def add_handler(self, name: str, handler: Handler) -> None:
        self.net.handlers.setdefault(self.peer_id, {})[name] = handler

    async def remove_handler(self, name: str) -> None:
        self.net.handlers.get(self.peer_id, {}).pop(name, None)

    async def open(self, peer: str, name: str) -> Streams:
        handler = self.net.handlers.get(peer, {}).get(name)
        if handler is None:
            raise ConnectionRefusedError(f"{peer} does not serve {name}")
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=a)
        served_reader, served_writer = await asyncio.open_connection(sock=b)
        self.net.opened.append(writer)
        self.net.served.setdefault(peer, []).append(served_writer)

        async def serve() -> None:
            try:
                await handler(SimpleNamespace(peer_id=self.peer_id), served_reader, served_writer)
            except (ConnectionError, OSError):
                pass
            finally:
                served_writer.close()

        task = asyncio.create_task(serve())
        self.net.tasks.add(task)
        task.add_done_callback(self.net.tasks.discard)
        return reader, writer


class PausingGuard:
    """``guard`` whose streams to ``peer`` hand out ``after`` bytes, then set ``paused`` and wait for ``resume``."""

    def __init__(self, guard: StreamGuard, peer: str, after: int) -> None:
        self.guard = guard
        self.peer = peer
        self.after = after
        self.paused = asyncio.Event()
        self.resume = asyncio.Event()
        self.received = 0  # bytes read from ``peer``'s streams, framing included

    async def open(self, peer: str, name: str) -> Streams:
        reader, writer = await self.guard.open(peer, name)
        if peer != self.peer:
            return reader, writer
        return cast(asyncio.StreamReader, _PausingReader(self, reader)), writer

    def as_guard(self) -> StreamGuard:
        return cast(StreamGuard, self)


class _PausingReader:
    def __init__(self, owner: PausingGuard, reader: asyncio.StreamReader) -> None:
        self.owner = owner
        self.reader = reader

    async def read(self, n: int = -1) -> bytes:
        owner = self.owner
        if owner.received >= owner.after and not owner.resume.is_set():
            owner.paused.set()
            await owner.resume.wait()
        if not owner.resume.is_set():
            n = min(n if n >= 0 else owner.after, owner.after - owner.received)
        data = await self.reader.read(n)
        owner.received += len(data)
        return data

    async def readexactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            piece = await self.read(n - len(data))
            if not piece:
                raise asyncio.IncompleteReadError(data, n)
            data += piece
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reader, name)
