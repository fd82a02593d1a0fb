"""The types every part of a round shares: who is in it (Group) and what happened (RoundReport)."""

from __future__ import annotations

from dataclasses import dataclass, field

STATE_KIND = "state"  # the kind of a round key ('<prefix>.<kind>.<step>') that averages one state


def round_key(prefix: str, kind: str, step: int) -> str:
    """The matchmaking key of round ``step`` of ``kind`` ('grad', 'outer', STATE_KIND) in swarm ``prefix``."""
    return f"{prefix}.{kind}.{step}"


def is_state_round(round_id: str) -> bool:
    """Whether round ``round_id`` ('<key>/<digest>') averages one state: there honest members send identical
    rows, so identical rows are members that agree, not one sybil's copies. Every member, and a third party
    judging a dispute, reads it from the id all of them sign, so no one's word decides it."""
    parts = round_id.rsplit("/", 1)[0].rsplit(".", 2)
    return len(parts) == 3 and parts[1] == STATE_KIND and parts[2].isdigit()


@dataclass(frozen=True)
class Group:
    """The members of one all-reduce round, in rank order; identical on every member."""

    round_id: str
    members: tuple[str, ...]

    def rank_of(self, peer_id: str) -> int:
        return self.members.index(peer_id)


@dataclass
class Clipping:
    """What a robust rule did to one member's contribution to one reducer's span in one round."""

    span: int  # the reducer's rank
    claimed_weight: float
    weight: float  # the smallest weight it was given in any chunk, after capping
    chunks: int = 0  # chunks in which it was clipped or weight-capped
    kept: float = 1.0  # smallest fraction of its deviation from the center kept in any chunk (1: not clipped)


@dataclass
class RoundReport:
    """What happened in one round, for logs, status and metrics."""

    round_id: str
    group_size: int
    duration: float = 0.0
    bytes_sent: int = 0  # contributions and averages, with their framing
    bytes_received: int = 0
    check_bytes_sent: int = 0  # the verification's: seals, statements, seed shares, samples, challenges, rows
    check_bytes_received: int = 0
    codec_error: float = 0.0  # relative L2 error of this peer's coded contributions
    excluded: dict[str, str] = field(default_factory=dict)  # peer id -> reason
    failed_spans: list[int] = field(default_factory=list)
    aggregation: str = "mean"  # the rule this peer's span was combined with
    clipped: dict[str, Clipping] = field(default_factory=dict)  # peer id -> what this peer's span did to it
    unverified: dict[int, str] = field(default_factory=dict)  # span -> why its average was not applied
    accused: dict[str, str] = field(default_factory=dict)  # peer id -> the lie this peer caught it in
