"""This peer in the swarm's records: its record published every refresh, its leaving announced, the others'
records listed for status, and whether that list is whole (split-brain detection, ``view.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from peerd.config import SwarmConfig
from peerd.errors import PeerdError
from peerd.swarm.node import SwarmNode, now
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

    async def publish(self) -> None:
        try:
            await self.swarm.publish(self.record())
        except PeerdError as e:  # a busy swarm (64 peers on 2 cores) can time a store out: retried next tick
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
        started = time.monotonic()
        try:
            seen = await self.swarm.read_peers()
        except PeerdError as e:
            live = []
            rebootstrap = self.view.failed_read(str(e), time.monotonic())
        else:
            self.view.read_seconds.append(time.monotonic() - started)
            live = [peer.record for peer in seen if peer.record.state is not PeerState.LEAVING]
            rebootstrap = self.view.observe([r.peer_id for r in live], {r.peer_id: r.peers_seen for r in live},
                                            time.monotonic())
        if rebootstrap:
            reporter = [r.maddrs[0] for r in live if r.peer_id == self.view.verdict.reporter and r.maddrs]
            self.view.rebootstrapped(await self.swarm.rebootstrap(reporter))
            self.republish.set()  # store our record where the refreshed routing table says it belongs

    async def peers(self) -> tuple[list[dict[str, Any]], str | None]:
        """The others' records as status shows them (with expiry, age and how we reach each), and the DHT
        error if the read failed."""
        try:
            seen = await self.swarm.read_peers()
        except PeerdError as e:
            return [], str(e)
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
        return peers, None
