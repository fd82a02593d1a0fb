"""peerd's requests to p2pd's control socket (peerd.wire.p2pd_control) close their connection on every way
out, on real p2pd: when p2pd refuses a stream, and when a dial is cancelled by a timeout while p2pd still
dials. hivemind's own calls for the same leave it open (the baseline), which a later garbage collection
reports as an unclosed socket, in whatever test runs then."""

from __future__ import annotations

import asyncio
import gc
import socket
import warnings
from collections.abc import Awaitable, Callable

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from multiaddr import Multiaddr

from peerd.wire import p2pd_control

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# no p2pd answers for this id; the dial goes to a TCP listener that accepts and never speaks
SILENT = PeerID.from_base58("QmSoLPppuBtQSGwKDZT2M73ULpjvfd3aZ6ha4oFGL1KrGM")

Call = Callable[[P2P, PeerID, Multiaddr], Awaitable[object]]
CALLS: dict[str, dict[str, Call]] = {
    "a stream p2pd refuses": {
        "peerd": lambda p2p, peer, _: p2pd_control.open_stream(p2p, peer, "/peerd/nobody-serves-this"),
        "hivemind": lambda p2p, peer, _: p2p.call_binary_stream_handler(peer, "/peerd/nobody-serves-this"),
    },
    "a dial cancelled by a timeout": {
        "peerd": lambda p2p, _, silent: p2pd_control.connect(p2p, SILENT, [silent]),
        "hivemind": lambda p2p, _, silent: p2p._client.connect(SILENT, [silent]),
    },
}


async def fail(call: Call) -> None:
    a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    b = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                         initial_peers=[str(m) for m in await a.get_visible_maddrs()])
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        silent = Multiaddr(f"/ip4/127.0.0.1/tcp/{listener.getsockname()[1]}")
        with pytest.raises((ControlFailure, TimeoutError)):  # p2pd's refusal, or the timeout
            await asyncio.wait_for(call(b, a.peer_id, silent), 1.0)
    finally:
        listener.close()
        await b.shutdown()
        await a.shutdown()


def left_open(call: Call) -> list[str]:
    """The ResourceWarnings a garbage collection reports once the call failed and its event loop is gone."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        asyncio.run(fail(call))
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


@pytest.mark.parametrize("way", list(CALLS))
def test_a_failed_control_request_leaves_no_connection_open(way: str) -> None:
    assert left_open(CALLS[way]["peerd"]) == []
    leaked = left_open(CALLS[way]["hivemind"])
    assert any("unclosed" in message for message in leaked), leaked
