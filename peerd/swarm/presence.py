"""This peer in the swarm's records: its record published every refresh, its leaving announced, the others'
records listed for status, and whether that list is whole (split-brain detection, ``view.py``).

A read of all records moves every record from each DHT node it asks, so neither status (the status page polls
every 2 s, Prometheus scrapes, ``peerd status`` runs in loops) nor the view check pays for one per call: a read
that began within one record refresh period (records change no faster) is reused, and concurrent reads share
one DHT request. So a peer reads the records at most once per refresh period, however often it is asked;
status says how old its list is (``peers_read_age``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from peerd.config import SwarmConfig
from peerd.errors import PeerdError
from peerd.swarm.node import SeenPeer, SwarmNode, now
from peerd.swarm.records import PeerRecord, PeerState
from peerd.swarm.view import ViewWatch

logger = logging.getLogger(__name__)

__all__ = ["Presence"]


class Presence:
    def __init__(self, swarm: SwarmNode, config: SwarmConfig, record: Callable[[], PeerRecord]) -> None:
        """``record``: builds this peer's current record (the daemon knows its state, roles and experts)."""
        self.swarm = swarm
        self.record = record
        self.view = ViewWatch(config.initial_peers, swarm.peer_id, config.record_refresh_period)
        self.republish = asyncio.Event()  # set: publish at the next tick rather than after a whole period
        self.reuse_within = config.record_refresh_period  # a read this recent is as fresh as the records
        self._last_read: tuple[float, list[SeenPeer]] | None = None  # (monotonic start, records)
        self._reading: asyncio.Task[tuple[float, list[SeenPeer]]] | None = None

    async def publish(self) -> None:
        try:
            await self.swarm.publish(self.record())
        except PeerdError as e:  # a busy swarm can time a store out: retried next tick
            logger.warning("Could not refresh our peer record: %s", e)

    async def refresh(self) -> None:
        """One supervision tick: our record again, and the view check when it is due."""
        await self.publish()
        if self.view.due(time.monotonic()):
            await self.check_view()

    async def leave(self) -> None:
        """Replaces our record with the leaving one ``record`` now builds (the daemon set its state first)."""
        try:
            await self.swarm.publish_leaving(self.record())
            logger.info("Announced leaving to the swarm")
        except PeerdError as e:
            logger.warning("Could not announce leaving: %s", e)

    async def check_view(self) -> None:
        """Reads every record, compares the view with what the others report and with the initial peers, and
        re-bootstraps when it stays partial (a read that keeps failing counts as a partial view)."""
        try:
            _, seen = await self.read()
        except PeerdError as e:
            live = []
            rebootstrap = self.view.failed_read(str(e), time.monotonic())
        else:
            live = [peer.record for peer in seen if peer.record.state is not PeerState.LEAVING]
            rebootstrap = self.view.observe([r.peer_id for r in live], {r.peer_id: r.peers_seen for r in live},
                                            time.monotonic())
        if rebootstrap:
            reporter = [r.maddrs[0] for r in live if r.peer_id == self.view.verdict.reporter and r.maddrs]
            self.view.rebootstrapped(await self.swarm.rebootstrap(reporter))
            self.republish.set()  # store our record where the refreshed routing table says it belongs

    async def read(self) -> tuple[float, list[SeenPeer]]:
        """Every record (``SwarmNode.read_peers``) and the monotonic time its read began: the last read if it
        began within ``reuse_within`` seconds, else the one in flight, else a new one."""
        if self._last_read is not None and time.monotonic() - self._last_read[0] <= self.reuse_within:
            return self._last_read
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read_now())
            # every waiter may have given up before a failed read ends; its error is then nobody's to report
            self._reading.add_done_callback(_retrieve)
        # shielded: a status request that gives up must not cancel the read the view check waits on
        return await asyncio.shield(self._reading)

    async def _read_now(self) -> tuple[float, list[SeenPeer]]:
        started = time.monotonic()
        seen = await self.swarm.read_peers()
        self.view.read_seconds.append(time.monotonic() - started)
        self._last_read = (started, seen)
        return self._last_read

    async def peers(self) -> tuple[list[dict[str, Any]], float | None, str | None]:
        """The others' records as status shows them (with expiry, age and how we reach each), the age of
        the read they come from (seconds), and the DHT error if the read failed."""
        try:
            read_at, seen = await self.read()
        except PeerdError as e:
            return [], None, str(e)
        current = now()
        peers = []
        for peer in seen:
            if peer.record.peer_id == self.swarm.peer_id:
                continue
            entry = peer.record.to_wire()
            entry["expires_in"] = round(peer.expires_at - current, 2)
            entry["age"] = round(current - peer.record.updated_at, 2)
            entry["connection"] = self.swarm.reach.via(peer.record.peer_id)
            peers.append(entry)
        return peers, round(time.monotonic() - read_at, 2), None


def _retrieve(read: asyncio.Future[Any]) -> None:
    if not read.cancelled():
        read.exception()  # marks it retrieved: asyncio would log "Task exception was never retrieved"
