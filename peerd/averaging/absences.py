"""Members that kept this peer waiting out a round: in memory, bounded, expiring, this peer's own.

A member grouped in a round that never sends its contribution, or never answers as the reducer of its span, costs
every other member the round's timeout (``averaging.round_timeout``) before the round goes on without it. Any
registrant can do that in every round it is grouped in, and an absence proves nothing to a third party (the
member may say it sent; a network fault looks the same), so nothing here is shared or shown to others as
evidence.

What this peer does with what it saw itself: a member it waited out (left out at a round's timeout, by its own
reducer or as a reducer its exchange gave up on) is *watched* in its later rounds for ``ABSENT_SECONDS``. A
watched member is waited for only a ``grace`` beyond the rest: as long again as the rest took, at least a fifth
of ``averaging.join_timeout`` and at most all of it. A chunk of its contribution that arrives that long after
every other member's, or its span's average still missing that long after every other span's, is left out of
this round, as the timeout would have left it out (and its span's average is not waited for at all once its
contribution to this peer's span was left out so in the same round: no span's average exists before its
contributions do, so the two waits would only add up). It is not excluded: a watched member that keeps pace is
averaged with as before, and the first round it completes ends the watch. So a liar that makes an honest member
look absent once (by splitting a round's decision) costs that member nothing unless it also falls behind the
rest of its group.

A watched member absent *again* is named in this peer's matchmaking registrations (``apart``) for
``APART_SECONDS``, doubling with each further absence while it stays watched, up to half of ``ABSENT_SECONDS``
(so that the watch outlasts it, and a member back in a group is still waited for only a grace). That is a
request about this peer's own grouping, not an accusation: matchmaking groups a registrant apart only when
more than half of the others of a group of its size name it (``decisions.partition``), so a liar naming an
honest member changes nothing for it, and a member absent again from a group of honest members averages with
none of them until its time is up, instead of costing each of their rounds a grace.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from peerd.averaging.group import Group
from peerd.bounded import remember

__all__ = ["ABSENT_SECONDS", "APART_SECONDS", "MAX_APART", "Absences", "grace"]

logger = logging.getLogger(__name__)

ABSENT_SECONDS = 300.0  # as long as a silent leader is passed over (matchmaking.SKIP_SECONDS)
MAX_ABSENT = 1024
APART_SECONDS = 30.0  # the first time a watched member is absent again; doubling, up to ABSENT_SECONDS / 2
MAX_APART = 64  # members one registration names (matchmaking.decisions.Entry.apart)
MIN_GRACE = 0.2  # of join_timeout: members of one round learn of it, and start, at slightly different times


def grace(elapsed: float, join_timeout: float) -> float:
    """Seconds a watched member is waited for beyond the rest of its round, which took ``elapsed`` seconds to get
    this far. Scaled to the round, so that a watched member keeping pace on slow links is not left out, while one
    that never comes costs a round of fast links little more than the round itself."""
    return min(join_timeout, max(MIN_GRACE * join_timeout, elapsed))


@dataclass
class _Watch:
    until: float  # watched until (monotonic)
    why: str
    again: int = 0  # absences since the watch began
    apart_until: float = 0.0  # named in this peer's registrations until then


class Absences:
    def __init__(self, seconds: float = ABSENT_SECONDS, limit: int = MAX_ABSENT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.limit, self.clock = seconds, limit, clock
        self._watches: OrderedDict[str, _Watch] = OrderedDict()

    def watched(self, members: Iterable[str]) -> set[str]:
        """Those of ``members`` watched now."""
        now = self.clock()
        return {m for m in members if m in self._watches and self._watches[m].until > now}

    def apart(self) -> list[str]:
        """Watched members absent again lately, that this peer's registrations ask to be grouped apart from: the
        ``MAX_APART`` latest."""
        now = self.clock()
        return [peer for peer, watch in self._watches.items() if watch.apart_until > now][-MAX_APART:]

    def saw(self, member: str, why: str) -> None:
        """``member`` kept this peer waiting out a round: watched for the next ``seconds``; asked to be grouped
        apart from if it was watched already."""
        now, why = self.clock(), why[:300]
        watch = self._watches.get(member)
        if watch is None or watch.until <= now:
            logger.warning("Watching %s in this peer's rounds for %.0f s: %s", member, self.seconds, why)
            watch = _Watch(now + self.seconds, why)
        else:
            watch.again += 1
            apart = min(self.seconds / 2, APART_SECONDS * 2 ** (watch.again - 1))
            watch.until, watch.why, watch.apart_until = now + self.seconds, why, now + apart
            logger.warning("%s, watched, kept a round waiting again (%s): this peer asks to be grouped apart from "
                           "it for %.0f s", member, why, apart)
        remember(self._watches, member, watch, self.limit)

    def kept_pace(self, member: str) -> None:
        """``member`` completed a round with this peer: the watch ends."""
        if self._watches.pop(member, None) is not None:
            logger.info("%s completed a round with this peer: no longer watched", member)

    def note(self, group: Group, me: str, late: dict[str, str], excluded: Collection[str]) -> None:
        """After a round of ``group``: the members in ``late`` (peer id -> how) kept it waiting and are watched;
        the others that were not ``excluded`` from it took part in full, and their watch ends."""
        for member in group.members:
            if member in late:
                self.saw(member, f"round {group.round_id}: {late[member]}")
            elif member != me and member not in excluded:
                self.kept_pace(member)

    def status(self) -> dict[str, dict[str, Any]]:
        now = self.clock()
        return {peer: {"reason": watch.why, "seconds_left": round(watch.until - now, 1),
                       "apart_seconds_left": round(max(0.0, watch.apart_until - now), 1)}
                for peer, watch in list(self._watches.items()) if watch.until > now}
