"""What a matchmaking entry may claim, and what every reader checks before it believes a leader's groups.

One entry per peer per round key, under the peer's own id (``peerd.swarm.signing`` allows no other subkey):
a registration ``{peer_id, t}``, replaced by the leader with its decision ``{peer_id, t, groups}``. Nothing in
an entry is believed because its author said it:

- ``t`` orders registrations and so picks the leader (the earliest). A reader takes only times it finds
  plausible: not before its own registration by more than a leader can wait plus the clock offsets the
  DHT admits, not after its own clock by more than those offsets (a registration at time 0 would make its
  author the leader of every round).
- A decision is taken only from a registrant, and only if its groups are what :func:`split` makes of the
  peers it names, in registration order: every member a registrant this reader sees, none twice, groups of
  ``target_group_size`` in order with a last one too small merged into the one before. A leader can still
  leave registrants out (it may not have received them), but cannot choose who is grouped with whom or how
  many. Every member of a swarm must use the same ``averaging.target_group_size`` and ``min_group_size``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from peerd.swarm.records import PeerIdStr

__all__ = ["PENDING", "Entry", "decision_problem", "leader", "ordered", "split"]

PENDING = "names a peer whose registration this peer has not read (yet)"


class Entry(BaseModel):
    """One peer's matchmaking entry for one round key."""

    model_config = ConfigDict(extra="ignore", strict=True)
    peer_id: PeerIdStr
    t: float = Field(ge=0, allow_inf_nan=False)
    groups: list[Annotated[list[PeerIdStr], Field(min_length=1, max_length=64)]] | None = Field(
        default=None, max_length=1024)


def ordered(times: Mapping[str, float]) -> list[str]:
    """Peers in registration order (ties: peer id): the order every reader of the same entries sees."""
    return sorted(times, key=lambda peer: (times[peer], peer))


def leader(times: Mapping[str, float]) -> str:
    return ordered(times)[0]


def split(peers: Sequence[str], target_group_size: int, min_group_size: int) -> list[list[str]]:
    """``peers`` (in registration order) in groups of ``target_group_size``; a last group below
    ``min_group_size`` is merged into the one before rather than left alone. Within a group, members are
    sorted by peer id: a member's rank (the span it reduces, where that span's error-feedback residual stays)
    then stays the same round after round for the same peers."""
    chunks = [list(peers[i : i + target_group_size]) for i in range(0, len(peers), target_group_size)]
    if len(chunks) > 1 and len(chunks[-1]) < min_group_size:
        chunks[-2].extend(chunks.pop())
    return [sorted(chunk) for chunk in chunks]


def decision_problem(groups: Sequence[Sequence[str]], times: Mapping[str, float], target_group_size: int,
                     min_group_size: int) -> str | None:
    """Why ``groups`` is not a decision this reader can take (:data:`PENDING` if it names a peer whose
    registration this reader has not read), or None. ``times``: the registrations it read, plausible ones only."""
    members = [member for group in groups for member in group]
    if len(set(members)) != len(members):
        return "names a peer twice"
    if any(member not in times for member in members):
        return PENDING
    expected = split(ordered({member: times[member] for member in members}), target_group_size, min_group_size)
    if [list(group) for group in groups] != expected:
        return (f"groups of sizes {[len(g) for g in groups]} are not its {len(members)} members in registration "
                f"order in groups of {target_group_size} (sizes {[len(g) for g in expected]})")
    return None
