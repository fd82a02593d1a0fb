"""Which remote experts a caller may route to: their DHT records, re-read periodically, and per-expert backoff.

Lives on the daemon's event loop; MoE layers on worker threads read it without a lock (the record map is
replaced whole on every refresh, never mutated). An expert is routable when its record is unexpired, its host
speaks this expert protocol, its width matches and it is not backing off. A failed call makes its expert back
off for ``retry_after`` seconds, doubling per consecutive failure up to :data:`MAX_BACKOFF`; a success, or a
new announcement from a restarted host (another ``started_at``), makes it routable again at once. An expert
whose answer its layer left out as too large (:mod:`peerd.experts.client.layer`) is skipped the same way, on a
count of its own that only an answer within the bound, or another host, clears: the liar's calls succeed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from peerd.errors import PeerdError
from peerd.experts.records import PROTOCOL_VERSION, ExpertReader, SeenExpert, bind
from peerd.swarm.node import SwarmNode, now

__all__ = ["MAX_BACKOFF", "Backoff", "Distrust", "ExpertDirectory"]

logger = logging.getLogger(__name__)

MAX_BACKOFF = 60.0


@dataclass
class Backoff:
    until: float  # time.monotonic()
    delay: float
    started_at: float  # of the record that failed; a new announcement clears the backoff


@dataclass
class Distrust:
    until: float  # time.monotonic()
    delay: float
    peer_id: str  # the host whose answer was left out; another host of the uid starts afresh


class ExpertDirectory:
    def __init__(self, swarm: SwarmNode, key: str) -> None:
        self.swarm = swarm
        self.key = key
        self.records: dict[str, SeenExpert] = {}  # replaced whole: worker threads read it without a lock
        self.backoff: dict[str, Backoff] = {}
        self.distrust: dict[str, Distrust] = {}
        self._reader = ExpertReader(swarm.drop)
        self._loop = asyncio.get_running_loop()
        self._retry_after = 2.0
        self._refresh_period = math.inf
        self._refresher: asyncio.Task[None] | None = None
        self._found = threading.Event()
        self._waited = False

    def track(self, refresh_period: float, retry_after: float) -> None:
        """A MoE layer routes through this directory (any thread): starts the periodic refresh."""
        self._refresh_period = min(self._refresh_period, refresh_period)
        self._retry_after = retry_after
        self._loop.call_soon_threadsafe(self._ensure_refresher)

    def _ensure_refresher(self) -> None:
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.ensure_future(self._refresh_periodically())

    async def _refresh_periodically(self) -> None:
        while True:
            await self.refresh()
            # the refresh cadence, not a synchronisation wait; quicker while no expert is known (just joined)
            await asyncio.sleep(self._refresh_period if self.records else min(self._refresh_period, 0.2))

    async def refresh(self) -> None:
        try:
            claims = self._reader.parse(await self.swarm.read_entries(self.key))
        except PeerdError as e:
            logger.warning("Could not read expert records: %s", e)
            return
        # A uid stays with the host it is bound to while that host's record lives: a DHT read may come back
        # incomplete (a slow node), and another member may claim the uid (records.bind)
        records, contested = bind(claims, self.records, now())
        self._reader.contested(contested)
        for uid, backoff in list(self.backoff.items()):
            if uid in records and records[uid].record.started_at != backoff.started_at:
                del self.backoff[uid]  # the host restarted: give it a chance at once
        self.records = records
        if self.records:
            self._found.set()

    def wait_for_experts(self, timeout: float) -> bool:
        """Blocks a worker thread until some expert record was read, at most ``timeout`` seconds in all: a
        model's first passes right after joining should not fall back for lack of a first DHT answer, but a
        swarm without experts must not stall every pass."""
        if self._found.is_set() or self._waited:
            return self._found.is_set()
        found = self._found.wait(timeout)
        self._waited = True
        if not found:
            logger.warning(
                "No expert records found in the DHT within %.0fs; MoE layers output zeros until experts are announced",
                timeout,
            )
        return found

    def routable(self, uids: Iterable[str], hidden_dim: int) -> list[bool]:
        """Per uid: announced, unexpired, of width ``hidden_dim`` and not backing off. Any thread."""
        return [reason is None for reason in self.unroutable_reasons(uids, hidden_dim)]

    def unroutable_reasons(self, uids: Iterable[str], hidden_dim: int) -> list[str | None]:
        """Per uid: why it cannot be routed to now, or None if it can. Any thread."""
        records, current, clock = self.records, now(), time.monotonic()
        reasons: list[str | None] = []
        for uid in uids:
            seen = records.get(uid)
            backoff, distrust = self.backoff.get(uid), self.distrust.get(uid)
            if seen is None:
                reasons.append("not announced")
            elif seen.expires_at < current:
                reasons.append(f"record expired {current - seen.expires_at:.1f}s ago")
            elif seen.record.protocol_version != PROTOCOL_VERSION:
                reasons.append(f"its host speaks expert protocol {seen.record.protocol_version}, not {PROTOCOL_VERSION}")
            elif seen.record.hidden_dim != hidden_dim:
                reasons.append(f"width {seen.record.hidden_dim}, not {hidden_dim}")
            elif backoff is not None and backoff.until > clock:
                reasons.append(f"backing off for {backoff.until - clock:.1f}s")
            elif distrust is not None and distrust.until > clock and distrust.peer_id == seen.record.peer_id:
                reasons.append(f"answered out of bound: skipped for {distrust.until - clock:.1f}s")
            else:
                reasons.append(None)
        return reasons

    def failed(self, uid: str, seen: SeenExpert, reason: str) -> None:
        delay = self._next_delay(self.backoff.get(uid))
        self.backoff[uid] = Backoff(time.monotonic() + delay, delay, seen.record.started_at)
        logger.info("Expert %s at %s failed (%s); skipping it for %.1fs", uid, seen.record.peer_id, reason[:200], delay)

    def succeeded(self, uid: str) -> None:
        self.backoff.pop(uid, None)

    def left_out(self, uid: str, peer_id: str, reason: str) -> None:
        """An answer of ``uid`` by ``peer_id`` was out of bound: skip it for ``retry_after`` seconds, doubling per
        answer left out in a row up to :data:`MAX_BACKOFF`."""
        previous = self.distrust.get(uid)
        delay = self._next_delay(previous if previous is not None and previous.peer_id == peer_id else None)
        self.distrust[uid] = Distrust(time.monotonic() + delay, delay, peer_id)
        logger.info("Expert %s at %s answered out of bound (%s); skipping it for %.1fs", uid, peer_id, reason, delay)

    def within_bound(self, uid: str) -> None:
        self.distrust.pop(uid, None)

    def _next_delay(self, previous: Backoff | Distrust | None) -> float:
        """``retry_after`` after a first strike, then twice the previous delay, up to :data:`MAX_BACKOFF`."""
        return self._retry_after if previous is None else min(MAX_BACKOFF, previous.delay * 2)

    def backing_off_for(self, uid: str) -> float:
        """Seconds ``uid`` is still skipped for, after failures or answers out of bound."""
        clock = time.monotonic()
        until = max((s.until for s in (self.backoff.get(uid), self.distrust.get(uid)) if s is not None), default=clock)
        return round(until - clock, 2) if until > clock else 0.0

    def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            self._refresher = None
