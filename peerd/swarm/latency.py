"""How long this peer's DHT requests take lately, so waits that span a DHT round trip can scale with it.

On an idle machine or a LAN a store or a read answers in milliseconds; with many busy peers on few cores, or
across continents, in a second or more. A wait sized for the first (matchmaking's window) closes before the others'
registrations arrive in the second. Timed-out requests count at the timeout: at least that slow.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LatencyWindow"]


class LatencyWindow:
    """The last ``size`` request durations (seconds) and their median."""

    def __init__(self, size: int = 64) -> None:
        self._seconds: deque[float] = deque(maxlen=size)

    def record(self, seconds: float) -> None:
        self._seconds.append(max(0.0, seconds))

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Records how long the block ran, whether it returned or raised (a timeout is a slow request)."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.record(time.monotonic() - started)

    def median(self) -> float:
        """The median of the recorded durations; 0 before any request finished."""
        return statistics.median(self._seconds) if self._seconds else 0.0

    def __len__(self) -> int:
        return len(self._seconds)
