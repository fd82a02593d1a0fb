"""What a matchmaking entry may claim, and what every reader checks before it believes a leader's groups.

One entry per peer per round key, under the peer's own id (``peerd.swarm.signing`` allows no other subkey):
a registration ``{peer_id, t, apart}``, replaced by the leader with its decision ``{peer_id, t, apart, groups}``.
Nothing in an entry is believed because its author said it:

- ``t`` orders registrations and so picks the leader (the earliest). A reader takes only times it finds
  plausible: not before its own registration by more than a leader can wait plus the clock offsets the
  DHT admits, not after its own clock by more than those offsets (a registration at time 0 would make its
  author the leader of every round).
- ``apart`` names members that kept its author's rounds waiting twice (``absences.py``). It moves a member only
  when more than half of the others of a group of that member's size name it (:func:`partition`): one liar, or
  a minority of a group, moves nobody, while a member absent from a group of honest members is grouped apart
  from all of them.
- A decision is taken only from a registrant, and only if its groups are what :func:`partition` makes of the
  peers it names, in registration order: every member a registrant this reader sees, none twice, groups of
  ``target_group_size`` in order with a last one too small merged into the one before, those moved apart in
  groups of their own after the rest. A leader can still leave registrants out (it may not have received them),
  but cannot choose who is grouped with whom or how many. Every member of a swarm must use the same
  ``averaging.target_group_size`` and ``min_group_size``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from peerd.averaging.absences import MAX_APART
from peerd.swarm.records import PeerIdStr

__all__ = ["PENDING", "Entry", "decision_problem", "leader", "ordered", "partition", "split"]

PENDING = "names a peer whose registration this peer has not read (yet)"


class Entry(BaseModel):
    """One peer's matchmaking entry for one round key."""

    model_config = ConfigDict(extra="ignore", strict=True)
    peer_id: PeerIdStr
    t: float = Field(ge=0, allow_inf_nan=False)
    # members its author asks to be grouped apart from: they kept its rounds waiting twice (absences.py)
    apart: list[PeerIdStr] = Field(default_factory=list, max_length=MAX_APART)
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


def partition(peers: Sequence[str], apart: Mapping[str, Collection[str]], target_group_size: int,
              min_group_size: int) -> list[list[str]]:
    """:func:`split` of ``peers`` (in registration order), except that a peer more than half of the others of a
    group of its size name in ``apart`` (peer -> the peers it asks to be grouped apart from) is split among the
    peers so named, in groups after the rest. Only the members a group of it would hold can have seen it absent,
    hence the group's size, not the swarm's, sets the majority."""
    size = min(target_group_size, len(peers))
    among = set(peers)
    named = Counter(other for peer in peers for other in set(apart.get(peer, ())) if other in among and other != peer)
    moved = {peer for peer in peers if 2 * named[peer] > size - 1}
    return (split([p for p in peers if p not in moved], target_group_size, min_group_size)
            + split([p for p in peers if p in moved], target_group_size, min_group_size))


def decision_problem(groups: Sequence[Sequence[str]], times: Mapping[str, float],
                     apart: Mapping[str, Collection[str]], target_group_size: int,
                     min_group_size: int) -> str | None:
    """Why ``groups`` is not a decision this reader can take (:data:`PENDING` if it names a peer whose
    registration this reader has not read), or None. ``times``: the registrations it read, plausible ones only;
    ``apart``: what each of them asked to be grouped apart from."""
    members = [member for group in groups for member in group]
    if len(set(members)) != len(members):
        return "names a peer twice"
    if any(member not in times for member in members):
        return PENDING
    expected = partition(ordered({member: times[member] for member in members}), apart, target_group_size,
                         min_group_size)
    if [list(group) for group in groups] != expected:
        return (f"groups of sizes {[len(g) for g in groups]} are not its {len(members)} members in registration "
                f"order in groups of {target_group_size}, those most of a group asks to be apart from after the "
                f"rest (sizes {[len(g) for g in expected]})")
    return None
