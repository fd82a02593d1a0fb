"""The stream guard disconnects a peer that has not proven membership when it sends a wrong proof, or when
enough of its streams were refused (busy, or no handshake), and never a peer that proved it (peer ids are
libp2p's, authenticated)."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hivemind.p2p import P2P, PeerID

from peerd.config import StreamLimits
from peerd.errors import MembershipError
from peerd.wire import handshake, p2pd_control
from peerd.wire.guard import StreamGuard
from peerd.wire.membership import Membership

pytestmark = pytest.mark.timeout(30)

SECRET = Membership(bytes(range(32)))
PROTOCOL = "peerd.v1.test"
# libp2p-shaped ids (PeerID.from_base58 must parse them)
ME, MEMBER, STRANGER, SILENT = (str(PeerID.from_base58(x)) for x in (
    "QmXwLiFBnJqfAj5zHRQ4PaoBo8mFrqMs1vYUCy3hP9ViUW", "QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN",
    "QmcgpsyWgH8Y8ajJz1Cu72KnS5uo2Aa2LpzU7kinSupNKC", "QmSoLPppuBtQSGwKDZT2M73ULpjvfd3aZ6ha4oFGL1KrGM"))


class _Client:
    def __init__(self) -> None:
        self.disconnected: list[str] = []

    async def disconnect(self, peer_id: PeerID) -> None:
        self.disconnected.append(str(peer_id))


@pytest.fixture(autouse=True)
def _disconnects_through_the_fake_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard disconnects through p2pd's control socket; here, through the fake client that records it."""
    async def disconnect(p2p: Any, peer: PeerID) -> None:
        await p2p._client.disconnect(peer)

    monkeypatch.setattr(p2pd_control, "disconnect", disconnect)


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


def test_a_wrong_proof_disconnects_at_once_silence_after_enough_streams_and_a_member_never() -> None:
    async def main() -> tuple[list[str], list[str], list[str], int]:
        guard, client = _guard(unproven_handshake_timeout=0.3, handshake_timeout=0.3, max_unproven_refusals=2)
        served: list[str] = []
        # a member proves itself, then lets streams go silent: refused, never disconnected
        task, reader, writer = await _stream(guard, MEMBER, served)
        await handshake.initiate(reader, writer, SECRET, MEMBER, ME, PROTOCOL)
        await task
        for _ in range(3):
            task, reader, writer = await _stream(guard, MEMBER, served)
            await task
        # a stranger without the secret is told it is not a member, and disconnected at once
        task, reader, writer = await _stream(guard, STRANGER, served)
        with pytest.raises(MembershipError, match="HANDSHAKE_NOT_A_MEMBER"):
            await handshake.initiate(reader, writer, Membership(), STRANGER, ME, PROTOCOL)
        writer.close()  # as StreamGuard.open does: the guard waits for that before it counts the refusal
        await task
        await _settle(guard)
        after_proof = list(client.disconnected)
        # a silent peer (a member's stream closed early looks alike): once is a strike, the second disconnects
        task, reader, writer = await _stream(guard, SILENT, served)
        await task
        await _settle(guard)
        after_one = list(client.disconnected)
        task, reader, writer = await _stream(guard, SILENT, served)
        await task
        await _settle(guard)
        await _close_all()
        return after_proof, after_one, client.disconnected, guard.disconnected

    after_proof, after_one, disconnected, count = asyncio.run(main())
    assert after_proof == [STRANGER] and after_one == [STRANGER]
    assert disconnected == [STRANGER, SILENT] and count == 2
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
