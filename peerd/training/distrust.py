"""Members this trainer caught in a lie it checked itself, and for how long it ignores them.

A donor is accused only of what this peer proved: it sent a piece of state whose bytes do not hash to the
digest it announced for that piece (the joiner computes the root it checks against the vouched one from those
announced digests, so the announcement binds the donor). A stall, a refusal, a broken stream or a state that
moved on is no accusation (an honest donor does all of those). Every piece of a download comes from a single
donor, so a liar cannot get the next donor blamed for its bytes.

An accused member is not asked for state again, and its progress claims (step, vouched state) count for nothing,
until its exclusion ends: :data:`FIRST` seconds, doubling with each new accusation up to :data:`LONGEST`. At
most :data:`MAX_ENTRIES` members are remembered (the ones whose exclusion ends first are forgotten first), and
an entry is forgotten :data:`MEMORY` seconds after its exclusion ended: memory and time stay bounded whatever
peer ids a swarm shows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Distrust"]

logger = logging.getLogger(__name__)

FIRST = 600.0
LONGEST = 6 * 3600.0
MEMORY = 3600.0
MAX_ENTRIES = 256


@dataclass
class _Entry:
    until: float
    accusations: int
    reason: str


class Distrust:
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_entries: int = MAX_ENTRIES) -> None:
        self._clock = clock
        self._max = max_entries
        self._entries: dict[str, _Entry] = {}

    def accuse(self, peer: str, reason: str) -> float:
        """Excludes ``peer`` for a while (longer for every accusation it had before); returns the seconds."""
        now = self._clock()
        self._forget(now)
        entry = self._entries.pop(peer, None)
        accusations = entry.accusations + 1 if entry is not None else 1
        seconds = min(LONGEST, FIRST * 2.0 ** min(accusations - 1, 30))
        self._entries[peer] = _Entry(now + seconds, accusations, reason[:300])
        while len(self._entries) > self._max:
            soonest = min(self._entries, key=lambda p: self._entries[p].until)
            del self._entries[soonest]
        logger.warning("Excluding %s as a state donor and ignoring its progress claims for %.0fs: %s", peer,
                       seconds, reason)
        return seconds

    def excluded(self, peer: str) -> bool:
        entry = self._entries.get(peer)
        return entry is not None and self._clock() < entry.until

    def status(self) -> dict[str, dict[str, object]]:
        """The members excluded now: why, how many times, and for how many more seconds."""
        now = self._clock()
        self._forget(now)
        return {peer: {"reason": e.reason, "accusations": e.accusations, "seconds_left": round(e.until - now, 1)}
                for peer, e in self._entries.items() if now < e.until}

    def _forget(self, now: float) -> None:
        for peer in [p for p, e in self._entries.items() if e.until + MEMORY < now]:
            del self._entries[peer]
