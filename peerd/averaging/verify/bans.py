"""Who this peer no longer averages with, and why: in memory, bounded, expiring.

A peer is banned on evidence: for ``ban_seconds`` when the evidence convinces any member (a proof: signed
data whose check convicts its signer, which every honest member of the round receives and checks itself), for
``suspect_seconds`` when only this peer saw the fault and cannot show it to others. A false accusation gets
an honest member banned nowhere: a proof convicts only its own signer, and a suspicion stays with whoever had
it. The all-reduce consults the list: a banned peer's streams are refused and it is left out of every group
(every member holding the same proof leaves it out alike, so their groups still agree).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from peerd.bounded import remember
from peerd.config import VerificationConfig

__all__ = ["Ban", "BanList"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ban:
    reason: str
    proven: bool
    until: float  # on the list's clock


class BanList:
    def __init__(self, config: VerificationConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self._bans: OrderedDict[str, Ban] = OrderedDict()

    def ban(self, peer: str, reason: str, proven: bool) -> bool:
        """Bans ``peer``; True if it was not banned yet (a proof also upgrades a suspicion)."""
        current = self.get(peer)
        if current is not None and (current.proven or not proven):
            return False
        seconds = self.config.ban_seconds if proven else self.config.suspect_seconds
        remember(self._bans, peer, Ban(reason[:500], proven, self.clock() + seconds), self.config.max_bans)
        logger.warning("Excluding %s from averaging for %.0f s (%s): %s", peer, seconds,
                       "proven" if proven else "seen by this peer only", reason)
        return True

    def get(self, peer: str) -> Ban | None:
        ban = self._bans.get(peer)
        if ban is not None and ban.until <= self.clock():
            del self._bans[peer]
            return None
        return ban

    def reason(self, peer: str) -> str | None:
        ban = self.get(peer)
        return None if ban is None else f"banned{'' if ban.proven else ' (suspected)'}: {ban.reason}"

    def status(self) -> dict[str, dict[str, Any]]:
        now = self.clock()
        return {peer: {"reason": ban.reason, "proven": ban.proven, "seconds_left": round(ban.until - now, 1)}
                for peer, ban in list(self._bans.items()) if self.get(peer) is not None}
