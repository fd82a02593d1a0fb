"""Per-peer bounds on what inbound streams can make this daemon hold: stream slots and bytes in flight.

Stream slots are taken before a stream's first byte is read. Bytes are reserved when a frame's length has
been read and released once the frame is in: a peer that announces large frames on many streams and sends
them slowly would otherwise have us hold every partial frame at once. The frame reader finds the budget of
the stream it reads through a context variable that the guard sets for each handler task (tasks the handler
starts inherit it), so the protocols' read calls need no extra argument; reads outside a served stream (our
own requests' answers) have no budget and keep their per-read limits only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from peerd.errors import ProtocolViolation

__all__ = ["ByteBudget", "PeerSlots", "reserve_frame", "serving_budget"]


@dataclass
class ByteBudget:
    """Bytes in flight for one peer, checked against its own limit and a budget shared by all peers."""

    limit: int
    parent: ByteBudget | None = None
    used: int = 0

    def try_reserve(self, size: int) -> bool:
        if self.used + size > self.limit:
            return False
        if self.parent is not None and not self.parent.try_reserve(size):
            return False
        self.used += size
        return True

    def release(self, size: int) -> None:
        self.used -= size
        if self.parent is not None:
            self.parent.release(size)


serving_budget: ContextVar[ByteBudget | None] = ContextVar("peerd_serving_budget", default=None)


@contextmanager
def reserve_frame(size: int, peer: str, what: str) -> Iterator[None]:
    """Holds ``size`` bytes of the current stream's budget while a frame is read; ProtocolViolation if the
    peer already has too much in flight."""
    budget = serving_budget.get()
    if budget is None:
        yield
        return
    if not budget.try_reserve(size):
        raise ProtocolViolation(
            f"{peer} announced a {size}-byte {what} while {budget.used} bytes of its frames are in flight "
            f"(limit {budget.limit}, swarm.streams.max_pending_bytes_per_peer / max_pending_bytes)",
            peer_id=peer,
        )
    try:
        yield
    finally:
        budget.release(size)


@dataclass
class PeerSlots:
    """Open inbound streams per peer and in total; a peer's byte budget lives as long as it has streams."""

    per_peer: int
    total: int
    bytes_per_peer: int
    bytes_total: int
    open: dict[str, int] = field(default_factory=dict)
    budgets: dict[str, ByteBudget] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.shared = ByteBudget(self.bytes_total)

    @property
    def streams(self) -> int:
        return sum(self.open.values())

    def acquire(self, peer: str) -> ByteBudget | None:
        """The peer's budget if it may open one more stream, else None (it has too many, or everyone has)."""
        if self.open.get(peer, 0) >= self.per_peer or self.streams >= self.total:
            return None
        self.open[peer] = self.open.get(peer, 0) + 1
        return self.budgets.setdefault(peer, ByteBudget(self.bytes_per_peer, self.shared))

    def release(self, peer: str) -> None:
        left = self.open.get(peer, 0) - 1
        if left > 0:
            self.open[peer] = left
            return
        self.open.pop(peer, None)
        self.budgets.pop(peer, None)
