"""The stream guard disconnects a peer that has not proven membership when it fails a handshake or keeps
opening streams past its pool, and never a peer that proved it (peer ids are libp2p's, authenticated)."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hivemind.p2p import P2P, PeerID

from peerd.config import StreamLimits
from peerd.errors import MembershipError
from peerd.wire import handshake
from peerd.wire.guard import StreamGuard
from peerd.wire.membership import Membership

pytestmark = pytest.mark.timeout(30)

SECRET = Membership(bytes(range(32)))
OTHER_SECRET = Membership(bytes(32))
PROTOCOL = "peerd.v1.test"
# libp2p-shaped ids (PeerID.from_base58 must parse them)
ME, MEMBER, STRANGER = (str(PeerID.from_base58(x)) for x in (
    "QmXwLiFBnJqfAj5zHRQ4PaoBo8mFrqMs1vYUCy3hP9ViUW", "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN",
    "QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC"))


class _Client:
    def __init__(self) -> None:
        self.disconnected: list[str] = []

    async def disconnect(self, peer_id: PeerID) -> None:
        self.disconnected.append(str(peer_id))


def _guard(**limits: Any) -> tuple[StreamGuard, _Client]:
    client = _Client()
    p2p = SimpleNamespace(peer_id=ME, _client=client)
    return StreamGuard(cast(P2P, p2p), SECRET, StreamLimits(**limits)), client


async def _stream(guard: StreamGuard, peer: str, served: list[str],
                  ) -> tuple[asyncio.Task[None], asyncio.StreamReader, asyncio.StreamWriter]:
    """One inbound stream from ``peer`` being served by ``guard``; the other end for the test to speak (the
    guard closes its end; the test's end is in ``OPENED`` for :func:`_close_all`)."""
    a, b = socket.socketpair()
    (ra, wa), (rb, wb) = await asyncio.open_connection(sock=a), await asyncio.open_connection(sock=b)
    OPENED.append(wa)

    async def handler(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(str(info.peer_id))

    task = asyncio.ensure_future(guard._serve(PROTOCOL, handler, SimpleNamespace(peer_id=peer), rb, wb))
    return task, ra, wa


OPENED: list[asyncio.StreamWriter] = []


async def _close_all() -> None:
    for writer in OPENED:
        writer.close()
        await writer.wait_closed()
    OPENED.clear()


async def _settle(guard: StreamGuard) -> None:
    for _ in range(3):
        await asyncio.gather(*guard._disconnecting.values())
        await asyncio.sleep(0)


def test_failed_handshakes_disconnect_an_unproven_peer_and_never_a_member() -> None:
    async def main() -> tuple[list[str], list[str], int]:
        guard, client = _guard(unproven_handshake_timeout=0.3, handshake_timeout=0.3)
        served: list[str] = []
        # a member proves itself, then lets a stream go silent: it is refused, not disconnected
        task, reader, writer = await _stream(guard, MEMBER, served)
        await handshake.initiate(reader, writer, SECRET, MEMBER, ME, PROTOCOL)
        await task
        task, reader, writer = await _stream(guard, MEMBER, served)
        await task
        # a stranger with another secret, and a silent stranger: both disconnected
        task, reader, writer = await _stream(guard, STRANGER, served)
        with pytest.raises(MembershipError):
            await handshake.initiate(reader, writer, OTHER_SECRET, STRANGER, ME, PROTOCOL)
        await task
        await _settle(guard)
        first = list(client.disconnected)
        task, reader, writer = await _stream(guard, STRANGER, served)
        await task
        await _settle(guard)
        await _close_all()
        return first, client.disconnected, guard.disconnected

    first, disconnected, count = asyncio.run(main())
    assert first == [STRANGER]  # the wrong proof
    assert disconnected == [STRANGER, STRANGER] and count == 2  # and the silence
    assert MEMBER not in disconnected


@pytest.mark.parametrize("enabled", [True, False])
def test_streams_past_the_unproven_pool_disconnect_their_peer(enabled: bool) -> None:
    async def main() -> tuple[list[str], dict[str, int]]:
        guard, client = _guard(max_unproven_streams_per_peer=1, max_unproven_refusals=3,
                               unproven_handshake_timeout=5.0, disconnect_unproven=enabled)
        served: list[str] = []
        held, _, held_writer = await _stream(guard, STRANGER, served)  # silent: holds the one unproven slot
        for _ in range(3):
            task, reader, writer = await _stream(guard, STRANGER, served)
            with pytest.raises(MembershipError, match="HANDSHAKE_BUSY"):
                await handshake.initiate(reader, writer, SECRET, STRANGER, ME, PROTOCOL)
            writer.close()
            await task
            await _settle(guard)
            if enabled and _ < 2:
                assert client.disconnected == []  # below max_unproven_refusals
        disconnected = list(client.disconnected)
        held_writer.close()
        await held
        await _close_all()
        return disconnected, dict(guard.refused)

    disconnected, refused = asyncio.run(main())
    assert refused["busy"] == 3
    assert disconnected == ([STRANGER] if enabled else [])
