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
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from typing import Any

from peerd.averaging.group import Group
from peerd.bounded import remember

__all__ = ["ABSENT_SECONDS", "Absences", "grace"]

logger = logging.getLogger(__name__)

ABSENT_SECONDS = 300.0  # as long as a silent leader is passed over (matchmaking.SKIP_SECONDS)
MAX_ABSENT = 1024
MIN_GRACE = 0.2  # of join_timeout: members of one round learn of it, and start, at slightly different times


def grace(elapsed: float, join_timeout: float) -> float:
    """Seconds a watched member is waited for beyond the rest of its round, which took ``elapsed`` seconds to get
    this far. Scaled to the round, so that a watched member keeping pace on slow links is not left out, while one
    that never comes costs a round of fast links little more than the round itself."""
    return min(join_timeout, max(MIN_GRACE * join_timeout, elapsed))


class Absences:
    def __init__(self, seconds: float = ABSENT_SECONDS, limit: int = MAX_ABSENT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.limit, self.clock = seconds, limit, clock
        self._until: OrderedDict[str, tuple[float, str]] = OrderedDict()  # peer -> (watched until, why)

    def watched(self, members: Iterable[str]) -> set[str]:
        """Those of ``members`` watched now."""
        now = self.clock()
        return {m for m in members if m in self._until and self._until[m][0] > now}

    def saw(self, member: str, why: str) -> None:
        """``member`` kept this peer waiting out a round: watched for the next ``seconds``."""
        if member not in self.watched([member]):
            logger.warning("Watching %s in this peer's rounds for %.0f s: %s", member, self.seconds, why)
        remember(self._until, member, (self.clock() + self.seconds, why[:300]), self.limit)

    def kept_pace(self, member: str) -> None:
        """``member`` completed a round with this peer: the watch ends."""
        if self._until.pop(member, None) is not None:
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
        return {peer: {"reason": why, "seconds_left": round(until - now, 1)}
                for peer, (until, why) in list(self._until.items()) if until > now}
