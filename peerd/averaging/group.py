"""The types every part of a round shares: who is in it (Group) and what happened (RoundReport)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Group:
    """The members of one all-reduce round, in rank order; identical on every member."""

    round_id: str
    members: tuple[str, ...]

    def rank_of(self, peer_id: str) -> int:
        return self.members.index(peer_id)


@dataclass
class RoundReport:
    """What happened in one round, for logs, status and metrics."""

    round_id: str
    group_size: int
    duration: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    codec_error: float = 0.0  # relative L2 error of this peer's coded contributions
    excluded: dict[str, str] = field(default_factory=dict)  # peer id -> reason
    failed_spans: list[int] = field(default_factory=list)
