"""Group formation through the DHT: ready peers register for a round; the earliest one fixes the groups.

For round key ``K`` (run, model fingerprint, step, kind), each ready peer stores ``{t: its DHT time}`` under
``K`` with its peer id as subkey. The peer with the earliest registration (ties: smallest id) is the
leader: once the window after its own registration has passed, or as many peers as expected are in, it
splits the peers whose registrations it has received, in registration order, into groups of at most
``target_group_size`` and stores them under the subkey ``groups:<its peer id>``. A published decision is
final: every registrant that reads one takes it (among several, the one of the earliest registered leader),
so every member acts on the same list. A peer left in no group, or in one below ``min_group_size``, raises
GroupFailed.

The window stretches with the DHT's speed (6 times the median of this peer's recent request times, up to
``max_matchmaking_window``): on a busy swarm a follower's registration takes several requests to arrive, and a
window sized for an idle one closed before it did. A peer left out anyway (registered after the decision, or
alone in it) registers once more under ``<key>.late`` with the other latecomers, rather than stepping alone.

Clocks. ``t`` is read on its writer's clock, and peers' clocks differ by up to 3 s (what hivemind's DHT
admits: ``peerd.swarm.clock``). We chose to make no decision depend on comparing one peer's time with
another's, rather than to measure and correct offsets (a DHT round trip of unknown length would blur any
estimate, and every member would have to agree on it). ``t`` only orders registrations, which every reader
sees alike; the window is timed by the leader on its own monotonic clock from its own registration; the
groups hold what the leader had received when it closed, not the registrations whose ``t`` fell before a
cut-off (a peer 2 s ahead used to land past the leader's window and average in no round); and because
decisions are final, a peer whose clock is behind, registering after a decision, cannot make itself a
second leader with an earlier ``t``. So a skewed peer is grouped exactly as if its clock were right, at any
offset; only its place in the order moves.

Every entry is signed by the peer its subkey names (``peerd.swarm.signing``), so nobody can register for
another peer, and a decision is taken only from a registered peer: stored under its own subkey, it cannot
be overwritten by anyone else. Entries that fail validation are ignored, counted and logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Callable
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from peerd.averaging.group import Group
from peerd.config import AveragingConfig
from peerd.errors import GroupFailed, PeerdError, ProtocolViolation
from peerd.swarm.clock import round_lifetime
from peerd.swarm.node import SwarmNode, now
from peerd.swarm.records import PeerIdStr

logger = logging.getLogger(__name__)

GROUPS_PREFIX = "groups:"
POLL_INTERVAL = 0.1  # the first poll's delay; each next one is POLL_BACKOFF times longer, up to window/5
POLL_BACKOFF = 1.5
POLLS_PER_WINDOW = 5
# A follower's registration lands up to ~5 DHT request times after the leader's: the leader's progress record
# (stored beside its registration), the follower's progress pause (2) and read, then its own registration.
WINDOW_PER_LATENCY = 6.0
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,128}")


class _Registration(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    t: float = Field(ge=0, allow_inf_nan=False)


class _Groups(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    peer_id: PeerIdStr  # the leader, who signed the decision
    groups: list[Annotated[list[PeerIdStr], Field(min_length=1, max_length=64)]] = Field(max_length=1024)


def group_id(key: str, members: tuple[str, ...]) -> str:
    digest = hashlib.sha256("\n".join(members).encode()).hexdigest()[:12]
    return f"{key}/{digest}"


class Matchmaker:
    def __init__(self, swarm: SwarmNode, config: AveragingConfig, clock: Callable[[], float] = now) -> None:
        """``clock``: this peer's DHT time (tests give peers skewed ones)."""
        self.swarm = swarm
        self.config = config
        self.clock = clock

    async def form_group(self, key: str, expected_peers: int, window: float | None = None) -> Group:
        """Registers for round ``key`` and returns this peer's group; ``expected_peers`` lets the leader
        close early once that many peers (this one included) have registered. ``window``: how long the leader
        waits for them at least (default ``averaging.matchmaking_window``); every peer of a round must pass the
        same.

        A peer that registered after the leader closed (or was left alone by it) gets one more round,
        ``<key>.late``, among the other latecomers: on a busy swarm they are several, and averaging among
        themselves beats stepping alone."""
        base = self.config.matchmaking_window if window is None else window
        try:
            return await self._round(key, expected_peers, base)
        except _Late as late:
            try:
                return await self._round(f"{key}.late", late.latecomers, base)
            except GroupFailed as again:
                raise GroupFailed(f"{late}; then among the latecomers: {again}") from again

    async def _round(self, key: str, expected_peers: int, base: float) -> Group:
        me = self.swarm.peer_id
        limit = max(base, self.config.max_matchmaking_window)
        registered_at, started = self.clock(), time.monotonic()
        lifetime = round_lifetime(self.config, base)
        await self.swarm.store(key, me, {"peer_id": me, "t": registered_at}, registered_at + lifetime)
        window = self.window(base)  # after our own store, which the DHT's latency counts
        target = max(2, min(expected_peers, self.config.target_group_size * 64))
        # the leader may have waited up to `limit`, measured from a registration before ours
        deadline = started + limit + self.config.join_timeout + 2.0
        poll = POLL_INTERVAL
        while True:
            entries, decisions = await self._read(key)
            entries.setdefault(me, registered_at)  # our own store may not be readable yet
            published = _final(entries, decisions)
            if published is not None:
                break
            leader = _leader(entries)
            window_over = time.monotonic() >= started + window
            if leader == me and (window_over or len(entries) >= target):
                published = self._split(me, entries)
                await self.swarm.store(key, GROUPS_PREFIX + me, published.model_dump(), registered_at + lifetime)
                break
            if time.monotonic() > deadline:
                raise GroupFailed(f"no group decision for {key} within {deadline - started:.1f}s "
                                  f"(leader {leader} did not publish one)")
            # polling the DHT, which has no change notifications; every poll of every waiting peer is a lookup
            # that returns all registrations, so polls thin out while a round waits
            await asyncio.sleep(poll)
            poll = min(poll * POLL_BACKOFF, max(POLL_INTERVAL, window / POLLS_PER_WINDOW))
        # every expected peer that does not average in this round may come to the latecomers' one
        averaging = sum(len(members) for members in published.groups if len(members) >= self.config.min_group_size)
        latecomers = max(2, expected_peers - averaging)
        for members in published.groups:
            if me in members:
                if len(members) < self.config.min_group_size:
                    raise _Late(f"group for {key} has {len(members)} member(s), below min_group_size", latecomers)
                ordered = tuple(members)
                return Group(group_id(key, ordered), ordered)
        raise _Late(f"{key}: registered too late, the leader's groups do not include this peer (its window "
                    f"was {window:.1f}s here)", latecomers)

    def window(self, base: float) -> float:
        """How long a leader waits for registrations: ``base``, or longer while this peer's DHT requests are
        slow (a registration takes a store, and the peers that learn of the round from progress records a read
        and a store more, to arrive), up to ``averaging.max_matchmaking_window``."""
        slow = WINDOW_PER_LATENCY * self.swarm.latency.median()
        return min(max(base, self.config.max_matchmaking_window), max(base, slow))

    def _split(self, me: str, entries: dict[str, float]) -> _Groups:
        peers = sorted(entries, key=lambda peer: (entries[peer], peer))
        size = self.config.target_group_size
        chunks = [peers[i : i + size] for i in range(0, len(peers), size)]
        # A last group too small to average is merged into the previous one rather than left alone.
        if len(chunks) > 1 and len(chunks[-1]) < self.config.min_group_size:
            chunks[-2].extend(chunks.pop())
        # Registration time picks who is grouped together; within a group, a member's rank (the span it
        # reduces, and so where the error-feedback residual of that span's averages stays) follows its peer
        # id, so the same peers get the same spans round after round.
        return _Groups(peer_id=me, groups=[sorted(chunk) for chunk in chunks])

    async def _read(self, key: str) -> tuple[dict[str, float], dict[str, _Groups]]:
        """Registrations (peer id -> time) and decisions (leader -> groups), each signed by the peer its
        subkey names (the swarm node checked that)."""
        try:
            found = await self.swarm.read_subkeys(key)
        except PeerdError as e:
            logger.debug("Matchmaking read of %s failed: %s", key, e)
            return {}, {}
        entries: dict[str, float] = {}
        decisions: dict[str, _Groups] = {}
        for subkey, value in found.items():
            try:
                if subkey.startswith(GROUPS_PREFIX):
                    decision = _Groups.model_validate(value)
                    decisions[decision.peer_id] = decision
                elif _PEER_ID.fullmatch(subkey):
                    entries[subkey] = _Registration.model_validate(value).t
            except ValidationError as e:
                self.swarm.drop("malformed", ProtocolViolation(
                    f"malformed matchmaking entry {subkey[:140]!r} under {key}: {e.errors()[0]['msg']}",
                    peer_id=subkey[-128:]))
        return entries, decisions


class _Late(GroupFailed):
    """This peer is in no group of a round, or alone in one; ``latecomers``: the peers to expect in the
    latecomers' round (those expected in this one that do not average in it, itself included)."""

    def __init__(self, message: str, latecomers: int) -> None:
        super().__init__(message)
        self.latecomers = latecomers


def _leader(entries: dict[str, float]) -> str:
    return min(entries, key=lambda peer: (entries[peer], peer))


def _final(entries: dict[str, float], decisions: dict[str, _Groups]) -> _Groups | None:
    """The decision of the earliest registered peer that published one, if any: the same for every reader of
    the same entries. Two leaders publish only in a race (the later one had not yet received the earlier
    one's registration); a decision by a peer that did not register for the round is ignored."""
    deciders = [peer for peer in decisions if peer in entries]
    return decisions[_leader({peer: entries[peer] for peer in deciders})] if deciders else None
