"""State transfer between two real p2pd daemons, over each libp2p transport peerd supports: a joiner gets the
server's bytes intact, and every refusal reaches it as a StateError naming the server, not as a cut stream.

Over QUIC, a server that closes its stream right after its last write loses what p2pd had not sent yet, every
time (over TCP rarely): these tests are what keeps the server waiting for the joiner to close first."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable

import pytest
from hivemind.p2p import P2P

from peerd.config import StreamLimits
from peerd.errors import StateError
from peerd.training.sync import StateProvider, StateServer, download_state
from peerd.wire.guard import StreamGuard
from peerd.wire.membership import Membership
from tests.integration.transports import LISTEN

pytestmark = pytest.mark.timeout(90)

FINGERPRINT = "fp-test"
OPEN = Membership()


async def with_server(listen: str, provider: StateProvider, body: Callable[[StreamGuard, str], Awaitable[None]]) -> None:
    server_p2p = await P2P.create(host_maddrs=[listen])
    client_p2p = None
    try:
        client_p2p = await P2P.create(
            host_maddrs=[listen],
            initial_peers=[str(m) for m in await server_p2p.get_visible_maddrs()],
        )
        server = StateServer(StreamGuard(server_p2p, OPEN, StreamLimits()), FINGERPRINT, provider)
        await server.start()
        await body(StreamGuard(client_p2p, OPEN, StreamLimits()), str(server_p2p.peer_id))
        await server.stop()
    finally:
        if client_p2p is not None:
            await client_p2p.shutdown()
        await server_p2p.shutdown()


@pytest.mark.parametrize("transport", LISTEN)
def test_a_large_state_arrives_intact_every_time(transport: str) -> None:
    blob = os.urandom(6 << 20)  # several yamux windows: the tail is what a hasty close would lose

    async def provider() -> tuple[int, bytes]:
        return 17, blob

    async def body(client: StreamGuard, server_id: str) -> None:
        for _ in range(5):
            step, got = await download_state(client, server_id, FINGERPRINT, max_bytes=8 << 20, timeout=30)
            assert step == 17
            assert hashlib.sha256(got).digest() == hashlib.sha256(blob).digest()

    asyncio.run(with_server(LISTEN[transport], provider, body))


@pytest.mark.parametrize("transport", LISTEN)
def test_refusals_reach_the_joiner_with_their_reason(transport: str) -> None:
    serving: list[tuple[int, bytes] | None] = [None]

    async def provider() -> tuple[int, bytes] | None:
        return serving[0]

    async def body(client: StreamGuard, server_id: str) -> None:
        with pytest.raises(StateError, match="STATE_UNAVAILABLE not training") as unavailable:
            await download_state(client, server_id, FINGERPRINT, max_bytes=1 << 20, timeout=30)
        assert server_id in str(unavailable.value)

        serving[0] = (3, bytes(4096))
        with pytest.raises(StateError, match="STATE_FINGERPRINT_MISMATCH this peer trains fingerprint fp-test"):
            await download_state(client, server_id, "fp-other", max_bytes=1 << 20, timeout=30)
        with pytest.raises(StateError, match=r"offers 4096 bytes of state, above training.max_state_bytes \(1024\)"):
            await download_state(client, server_id, FINGERPRINT, max_bytes=1024, timeout=30)
        assert await download_state(client, server_id, FINGERPRINT, max_bytes=1 << 20, timeout=30) == (3, bytes(4096))

    asyncio.run(with_server(LISTEN[transport], provider, body))
