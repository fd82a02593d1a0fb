"""Bounded tables keyed by what a peer chooses (peer ids, keys, digests): a stranger mints new ones at will, so
every per-peer memory keeps at most a fixed number of entries, the least recently set dropped first."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

__all__ = ["remember"]

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
