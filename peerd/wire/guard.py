"""The one door of every peerd protocol: stream slots, then the membership handshake, then the handler.

Protocols register their handlers and open their streams here instead of on hivemind's P2P directly, so no
protocol can forget the handshake or the limits. Refusals are counted by reason and logged with the peer
id (at most once a minute per peer and reason: a stranger retrying must not flood the log).

Two pools of inbound streams. A peer that proved its membership to this one before (``proven``, the most
recent ``PROVEN_PEERS``; libp2p authenticates peer ids, so nobody else can use its id) takes a member's slot
(``swarm.streams.max_streams``) for each stream, handshake included. Any other peer's stream waits for its
handshake in the small pool of unproven streams, under a shorter deadline, and takes a member's slot only
once its proof checked out: strangers, however many identities they mint, hold at most that pool, never the
slots members use.

Every stream, refused or not, costs this daemon and its p2pd work before it can be refused, and a stranger's
streams are free to reopen. So a peer that has not proven membership is disconnected
(``swarm.streams.disconnect_unproven``) once it sends a wrong proof, or once ``max_unproven_refusals`` of its
streams were refused as busy or ended without a handshake: that ends all its streams at once, and it pays a
new connection to try again. Peer ids are authenticated by libp2p, so nobody can get another peer
disconnected.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import P2P, PeerID

from peerd.bounded import remember
from peerd.config import StreamLimits
from peerd.errors import MembershipError, ProtocolViolation, RPCTimeout
from peerd.log import RateLimitedLog
from peerd.proto import peerd_membership_pb2 as pb
from peerd.wire import handshake, p2pd_control
from peerd.wire.limits import ByteBudget, PeerSlots, serving_budget
from peerd.wire.membership import Membership

__all__ = ["Handler", "StreamGuard"]

logger = logging.getLogger(__name__)

# A protocol's handler: (stream info, reader, writer), as hivemind calls it, run after the handshake.
Handler = Callable[[Any, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
REFUSED_PEERS = 1024  # the most recently refused peers status remembers (a stranger mints peer ids at will)
PROVEN_PEERS = 4096
MAX_DISCONNECTING = 64  # disconnect requests to p2pd in flight at once; a flood of new identities waits its turn


class StreamGuard:
    def __init__(self, p2p: P2P, membership: Membership, limits: StreamLimits) -> None:
        self.p2p = p2p
        self.membership = membership
        self.limits = limits
        self.peer_id = str(p2p.peer_id)
        self.slots = PeerSlots(limits.max_streams_per_peer, limits.max_streams, limits.max_pending_bytes_per_peer,
                               limits.max_pending_bytes)
        # handshake messages are read under their own small limit, outside any byte budget
        self.unproven = PeerSlots(limits.max_unproven_streams_per_peer, limits.max_unproven_streams, 0, 0)
        self.proven: OrderedDict[str, None] = OrderedDict()  # peers that proved membership, newest last
        self.refused: Counter[str] = Counter()  # inbound streams refused, by reason
        self.refused_peers: OrderedDict[str, str] = OrderedDict()  # peer id -> its last refusal, newest last
        self.accepted = 0
        self.disconnected = 0  # unproven peers disconnected: a wrong proof, or too many streams refused
        self._strikes: OrderedDict[str, int] = OrderedDict()  # unproven peer -> streams refused, newest last
        self._disconnecting: dict[str, asyncio.Task[None]] = {}
        self._log = RateLimitedLog(logger, size=4096)

    # --- serving ----------------------------------------------------------------------------------------------

    async def add_handler(self, name: str, handler: Handler) -> None:
        async def guarded(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._serve(name, handler, info, reader, writer)

        await self.p2p.add_binary_stream_handler(name, guarded)

    async def remove_handler(self, name: str) -> None:
        await self.p2p.remove_binary_stream_handler(name)

    def known(self, peer: str) -> bool:
        """Whether ``peer`` proved its membership to this peer before (its streams then use members' slots)."""
        return peer in self.proven

    async def _serve(self, name: str, handler: Handler, info: Any, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        peer = str(getattr(info, "peer_id", "?"))
        known = self.known(peer)
        budget = self.slots.acquire(peer) if known else None
        try:
            if not (known and budget is not None or not known and self.unproven.acquire(peer) is not None):
                try:
                    await self._refuse_busy(peer, known, reader, writer)
                finally:  # the strike that disconnects comes after the busy answer, which the peer then reads
                    if not known:
                        self._strike(peer)
                return
            try:
                budget = await self._handshake(peer, name, known, reader, writer)
            finally:
                if not known:
                    self.unproven.release(peer)
            if budget is None:
                return
            self.accepted += 1
            # hivemind runs each stream's handler in a task of its own: the handler's frame reads (and those
            # of tasks it starts) count against this peer's budget
            token = serving_budget.set(budget)
            try:
                await handler(info, reader, writer)
            finally:
                serving_budget.reset(token)
        except ProtocolViolation as e:  # the handler's own refusals are logged by it; this is a limit or a bug
            logger.info("Dropped a %s stream from %s: %s", name, peer, e)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, TimeoutError) as e:
            logger.debug("Stream %s from %s broke: %r", name, peer, e)
        finally:
            if budget is not None:
                self.slots.release(peer)
            writer.close()

    async def _handshake(self, peer: str, name: str, known: bool, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> ByteBudget | None:
        """The member's byte budget once ``peer`` proved membership (a slot of it taken), else None (refused,
        counted and logged). A known peer already holds its slot; another takes one only after its proof."""
        taken: list[ByteBudget] = []

        def admit() -> str | None:
            if known:
                return None
            budget = self.slots.acquire(peer)
            if budget is None:
                return "too many streams open"
            taken.append(budget)
            return None

        timeout = self.limits.handshake_timeout if known else self.limits.unproven_handshake_timeout
        try:
            async with asyncio.timeout(timeout):
                await handshake.accept(reader, writer, self.membership, self.peer_id, peer, name, admit)
        except MembershipError as e:
            code = str(e.context.get("code", "refused"))
            self._refuse(peer, code, e.message)
            if not known and code in ("HANDSHAKE_NOT_A_MEMBER", "HANDSHAKE_BAD_PROOF"):
                self._disconnect(peer)
        except (ProtocolViolation, TimeoutError) as e:
            self._refuse(peer, "malformed", f"no handshake within {timeout:g}s" if isinstance(e, TimeoutError)
                         else str(e))
            if not known:  # also a member's first stream, closed early because its round ended: not at once
                self._strike(peer)
        else:
            self._strikes.pop(peer, None)
            remember(self.proven, peer, None, PROVEN_PEERS)
            return self.slots.budgets[peer] if known else taken[0]
        if known or taken:  # its member's slot goes back (a new one broke at the verdict, after taking it)
            self.slots.release(peer)
        return None

    async def _refuse_busy(self, peer: str, known: bool, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> None:
        if known:
            limits = f"more than {self.limits.max_streams_per_peer} streams open (or {self.limits.max_streams} from " \
                     "all members)"
        else:
            limits = f"more than {self.limits.max_unproven_streams_per_peer} streams waiting for their handshake " \
                     f"(or {self.limits.max_unproven_streams} from all unproven peers)"
        self._refuse(peer, "busy", limits)
        # the refusal is read before the stream closes; an unproven peer gets the short deadline for that
        timeout = self.limits.handshake_timeout if known else self.limits.unproven_handshake_timeout
        await asyncio.wait_for(handshake.refuse(reader, writer, pb.HANDSHAKE_BUSY, "too many streams"), timeout)

    def _strike(self, peer: str) -> None:
        remember(self._strikes, peer, self._strikes.get(peer, 0) + 1, REFUSED_PEERS)
        if self._strikes[peer] >= self.limits.max_unproven_refusals:
            self._disconnect(peer)

    def _disconnect(self, peer: str) -> None:
        """Closes every connection to ``peer``, which has not proven membership, in the background."""
        if (not self.limits.disconnect_unproven or peer in self.proven or peer in self._disconnecting
                or len(self._disconnecting) >= MAX_DISCONNECTING):
            return
        self._strikes.pop(peer, None)

        async def disconnect() -> None:
            try:
                await p2pd_control.disconnect(self.p2p, PeerID.from_base58(peer))
                self.disconnected += 1
            except Exception as e:  # noqa: BLE001 - best effort: the peer may have gone, or p2pd be stopping
                logger.debug("Could not disconnect %s: %r", peer, e)
            finally:
                self._disconnecting.pop(peer, None)

        self._disconnecting[peer] = asyncio.ensure_future(disconnect())

    def _refuse(self, peer: str, reason: str, message: str) -> None:
        self.refused[reason] += 1
        remember(self.refused_peers, peer, message[:300], REFUSED_PEERS)
        self._log((peer, reason), logging.WARNING, "Refused a stream from %s: %s", peer, message)

    # --- opening ----------------------------------------------------------------------------------------------

    async def open(self, peer: str, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A stream to ``peer``'s ``name`` handler, past the handshake. MembershipError if either side refuses
        (our allowlist, its secret or limits), RPCTimeout if the handshake stalls; libp2p's own errors pass."""
        if not self.membership.admits(peer):
            raise MembershipError(f"{peer} is not on this swarm's allowlist", peer_id=peer, code="NOT_ON_ALLOWLIST")
        reader, writer = await p2pd_control.open_stream(self.p2p, PeerID.from_base58(peer), name)
        try:
            async with asyncio.timeout(self.limits.handshake_timeout):
                await handshake.initiate(reader, writer, self.membership, self.peer_id, peer, name)
        except TimeoutError as e:
            writer.close()
            raise RPCTimeout(f"membership handshake with {peer} took over {self.limits.handshake_timeout:.0f}s",
                             peer_id=peer) from e
        except BaseException:
            writer.close()
            raise
        return reader, writer

    def status(self) -> dict[str, Any]:
        return {
            "mode": self.membership.describe(),
            "streams_open": self.slots.streams,
            "unproven_streams_open": self.unproven.streams,
            "streams_accepted": self.accepted,
            "peers_disconnected": self.disconnected,
            "streams_refused": dict(self.refused),
            "refused_peers": dict(list(self.refused_peers.items())[-20:]),
            "pending_bytes": self.slots.shared.used,
        }
