"""The requests to p2pd's control socket that peerd makes past hivemind's ``P2P`` API: open a stream, dial a
peer, disconnect a peer.

Each request is a connection to p2pd's control socket. hivemind's own calls for them close that connection
only when p2pd says yes; when it says no (the peer is gone, does not speak the protocol, the dial fails) or the
caller is cancelled while it waits (a timeout), the connection stays open until a garbage collection finds
it. Peers open streams to departed and refusing peers all the time, so here it is closed on every way out.

This module is the one place in peerd that reaches hivemind's control client (``P2P._client``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import raise_if_failed, read_pbmsg_safe, write_pbmsg
from hivemind.proto import p2pd_pb2
from multiaddr import Multiaddr

__all__ = ["connect", "disconnect", "open_stream"]


async def open_stream(p2p: P2P, peer: PeerID, protocol: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to ``peer``'s ``protocol`` handler; raises what p2pd answers (hivemind's ControlFailure)."""
    return await _request(p2p, p2pd_pb2.Request(
        type=p2pd_pb2.Request.STREAM_OPEN,
        streamOpen=p2pd_pb2.StreamOpenRequest(peer=peer.to_bytes(), proto=[protocol])))


async def connect(p2p: P2P, peer: PeerID, addresses: Iterable[Multiaddr]) -> None:
    """Dials ``peer`` at ``addresses`` (hivemind's ``P2P`` has no public dial)."""
    _, writer = await _request(p2p, p2pd_pb2.Request(
        type=p2pd_pb2.Request.CONNECT,
        connect=p2pd_pb2.ConnectRequest(peer=peer.to_bytes(), addrs=[a.to_bytes() for a in addresses])))
    writer.close()
    await writer.wait_closed()


async def disconnect(p2p: P2P, peer: PeerID) -> None:
    """Closes every connection p2pd holds to ``peer`` (hivemind's ``P2P`` has no call for it)."""
    _, writer = await _request(p2p, p2pd_pb2.Request(
        type=p2pd_pb2.Request.DISCONNECT, disconnect=p2pd_pb2.DisconnectRequest(peer=peer.to_bytes())))
    writer.close()
    await writer.wait_closed()  # as hivemind's own call: closed before the caller goes on


async def _request(p2p: P2P, request: p2pd_pb2.Request) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Sends ``request`` on a new control connection and reads p2pd's answer. Returns the connection, still
    open, if p2pd said yes (a stream's connection is the stream); closes it on every other way out."""
    reader, writer = await p2p._client.control.daemon_connector.open_connection()
    try:
        await write_pbmsg(writer, request)
        response = p2pd_pb2.Response()
        await read_pbmsg_safe(reader, response)
        raise_if_failed(response)
    except BaseException:
        writer.close()
        raise
    return reader, writer
