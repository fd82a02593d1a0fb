"""Bounded tables keyed by what a peer chooses (peer ids, keys, digests): a stranger mints new ones at will, so
every per-peer memory keeps at most a fixed number of entries, the least recently set dropped first. Among them,
the median-of-medians that bounds what one peer may send against what the others send (expert tensors, DHT
answer times)."""

from __future__ import annotations

import math
import statistics
import threading
from collections import OrderedDict, deque
from typing import TypeVar

__all__ = ["PeerMedians", "remember"]

K = TypeVar("K")
V = TypeVar("V")


def remember(table: OrderedDict[K, V], key: K, value: V, limit: int) -> list[tuple[K, V]]:
    """Sets ``table[key]`` as its newest entry and drops the oldest beyond ``limit``; returns what it dropped,
    oldest first (for tables that keep something beside each entry)."""
    table[key] = value
    table.move_to_end(key)
    dropped = []
    while len(table) > limit:
        dropped.append(table.popitem(last=False))
    return dropped


class PeerMedians:
    """What the typical peer sends, in a table no peer can steer alone: each peer's median over its last
    ``kept`` values, and the lower median of those over the ``peers`` heard from last. A peer has one vote
    however often it sends, and one that sends more than every other never sets the typical value; with two
    peers the smaller one sets it. Thread-safe: an expert host's compute threads share one."""

    def __init__(self, kept: int = 16, peers: int = 256) -> None:
        self._kept = kept
        self._peers = peers
        self._values: OrderedDict[str, deque[float]] = OrderedDict()
        self._medians: dict[str, float] = {}  # of each peer's kept values, updated when they change
        self._lock = threading.Lock()
        self._typical: float | None = None  # cached until the next observed value (a DHT request reads it thrice)
        self._stale = False

    def observe(self, peer: str, value: float) -> None:
        """Counts ``value`` in ``peer``'s median; values that are not positive and finite teach nothing."""
        if not (value > 0 and math.isfinite(value)):
            return
        with self._lock:
            kept = self._values.pop(peer, None) or deque(maxlen=self._kept)
            kept.append(value)
            self._medians[peer] = statistics.median(kept)
            for forgotten, _ in remember(self._values, peer, kept, self._peers):
                self._medians.pop(forgotten, None)
            self._stale = True

    def typical(self) -> float | None:
        """The lower median of the peers' medians (None before any peer sent a value)."""
        with self._lock:
            if self._stale:
                medians = sorted(self._medians.values())
                self._typical, self._stale = medians[(len(medians) - 1) // 2], False
            return self._typical

    def median(self, peer: str) -> float | None:
        """``peer``'s own median (None if it is not in the table)."""
        with self._lock:
            return self._medians.get(peer)

    def mean(self, peer: str) -> float | None:
        """The mean of ``peer``'s kept values (None if it is not in the table)."""
        with self._lock:
            kept = self._values.get(peer)
            return statistics.fmean(kept) if kept else None

    def count(self, peer: str) -> int:
        """How many of ``peer``'s values are kept."""
        with self._lock:
            return len(self._values.get(peer, ()))

    def __len__(self) -> int:
        """Peers whose values count."""
        with self._lock:
            return len(self._medians)

    def __contains__(self, peer: object) -> bool:
        with self._lock:
            return peer in self._medians
