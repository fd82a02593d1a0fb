"""An in-memory DHT for matchmaking tests: stores become readable after a delay, as a real store propagates."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from peerd.errors import ProtocolViolation
from peerd.swarm.latency import LatencyWindow


class MemoryDHT:
    """Keys' subkeys, each readable ``latency`` seconds after it was stored (as a DHT store propagates);
    a store returns after ``store_seconds``, as a lookup and a store take on a busy DHT."""

    def __init__(self, latency: float = 0.05, store_seconds: float = 0.0) -> None:
        self.latency = latency
        self.store_seconds = store_seconds
        self.values: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}


class MemorySwarm:
    """The SwarmNode methods matchmaking uses, on a shared in-memory DHT."""

    def __init__(self, peer_id: str, dht: MemoryDHT, drops: list[str] | None = None) -> None:
        """``drops``: where refused entries are counted; None: a refused entry fails the test."""
        self.peer_id = peer_id
        self.dht = dht
        self.latency = LatencyWindow()
        self.drops = drops

    async def store(self, key: str, subkey: str, value: dict[str, Any], expiration: float) -> bool:
        with self.latency.timing():
            await asyncio.sleep(self.dht.store_seconds)
            self.dht.values[key, subkey] = (time.monotonic() + self.dht.latency, value)
        return True

    async def read_subkeys(self, key: str) -> dict[str, object]:
        now = time.monotonic()
        return {subkey: value for (stored, subkey), (visible, value) in self.dht.values.items()
                if stored == key and visible <= now}

    def drop(self, reason: str, error: ProtocolViolation) -> None:
        if self.drops is None:
            raise AssertionError(f"unexpected drop: {error}")
        self.drops.append(reason)
