"""Whether this trainer still averages with the others it sees, said loudly when it stopped.

A swarm whose rounds all fail still trains (every peer steps alone) and its loss still falls, so nothing
but this tells a user that the peers no longer train together: clocks too far apart, a firewall, different
configs. A round counts against the streak when it ends without averaging although another trainer with
our model was in view. Once ``STALL_ROUNDS`` such rounds in a row have spanned at least ``grace`` seconds
(longer than a departed peer's progress record lingers, whose rounds fail until it expires), the streak is
a stall: one WARNING, ``stalled`` in the status, the status page and ``/metrics``. The first averaged round
ends it with one INFO line. A round with nobody else in view is no failure, and ends a streak too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

STALL_ROUNDS = 3


@dataclass
class AveragingHealth:
    grace: float = 20.0  # seconds a streak must span before it is a stall
    streak: int = 0  # rounds in a row without averaging while others were in view
    since: float | None = None  # unix time the streak began
    _began: float = 0.0  # time.monotonic() the streak began
    stalled: bool = False
    last_error: str | None = None
    others: int = 0  # other trainers in view at the last failed round

    def averaged(self) -> None:
        if self.stalled:
            logger.info("Averaging again after %d rounds without it (%.0f s)", self.streak, self._span())
        self._reset()

    def alone(self) -> None:
        """A round with no other trainer in view: stepping alone is all there is to do."""
        if self.stalled:
            logger.info("No other trainer in view any more; %d rounds went without averaging (%.0f s)",
                        self.streak, self._span())
        self._reset()

    def failed(self, error: str, others: int) -> None:
        """A round that ended without averaging although ``others`` other trainers were in view."""
        if self.streak == 0:
            self.since, self._began = time.time(), time.monotonic()
        self.streak += 1
        self.last_error, self.others = error, others
        if not self.stalled and self.streak >= STALL_ROUNDS and self._span() >= self.grace:
            self.stalled = True
            logger.warning(
                "Averaging has stopped: the last %d rounds (%.0f s) ended without averaging although %d other "
                "trainer%s %s in view, so this peer trains alone. Last failure: %s. Check `peerd status` on both "
                "sides: that they reach each other and that their clocks agree (NTP)",
                self.streak, self._span(), others, "" if others == 1 else "s", "is" if others == 1 else "are",
                error,
            )

    def _span(self) -> float:
        return time.monotonic() - self._began if self.streak else 0.0

    def _reset(self) -> None:
        self.streak, self.since, self.stalled, self.last_error, self.others = 0, None, False, None, 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "stalled": self.stalled,
            "failed_streak": self.streak,
            "failing_since": round(self.since, 3) if self.since is not None else None,
            "failing_for": round(self._span(), 1),
            "others_in_view": self.others,
            "last_error": self.last_error,
        }
