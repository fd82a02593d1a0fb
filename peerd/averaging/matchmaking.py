"""Group formation through the DHT: ready peers register for a round; the earliest one fixes the groups.

For round key ``K`` (run, model fingerprint, step, kind), each ready peer stores ``{t: its DHT time}`` under
``K`` with its peer id as subkey. The peer with the earliest registration (ties: smallest id) is the
leader: once the window after its own registration has passed, or as many peers as expected are in, it
splits the peers whose registrations it has received, in registration order, into groups of at most
``target_group_size`` and replaces its registration with that decision. A published decision is final:
every registrant that reads one takes it (among several, the one of the earliest registered leader), so
every member acts on the same list. A peer left in no group, or in one below ``min_group_size``, raises
GroupFailed.

Nothing a member writes is believed because it wrote it (``decisions.py``): implausible registration times
are dropped, and a decision whose groups are not the split of its members is refused and its author
skipped. A leader that does not decide in time (it left, or it never will) is skipped too: the next
registrant leads, and later rounds skip it from the start for ``SKIP_SECONDS`` (it still averages in them),
so a member that registers early and never decides costs one round a delay, not every round. Skips are each
peer's own: one that took a decision without waiting out the silent leader still waits for it, so a leader
behind a peer we skip gets the time of a fallback, not of a first leader, before we pass it over too.

The window stretches with the DHT's speed (6 times the median of this peer's recent request times, up to
``max_matchmaking_window``): on a busy swarm a follower's registration takes several requests to arrive, and a
window sized for an idle one closed before it did. A peer left out anyway (registered after the decision, or
alone in it) registers once more under ``<key>.late`` with the other latecomers, rather than stepping alone, if
by its count of the peers at this step others were left out too: alone, that round would only wait out its
window, and a diloco peer whose phase round is still in flight when its next phase ends would register late again.

Clocks. ``t`` is read on its writer's clock, and peers' clocks differ by up to 3 s (what hivemind's DHT
admits: ``peerd.swarm.clock``). We chose to make no decision depend on comparing one peer's time with
another's, rather than to measure and correct offsets (a DHT round trip of unknown length would blur any
estimate, and every member would have to agree on it). ``t`` only orders registrations, which every reader
sees alike; the window is timed by the leader on its own monotonic clock from its own registration; the
groups hold what the leader had received when it closed, not the registrations whose ``t`` fell before a
cut-off (a cut-off on ``t`` would leave a peer whose clock is ahead past every leader's window, averaging in no
round); and because
decisions are final, a peer whose clock is behind, registering after a decision, cannot make itself a
second leader with an earlier ``t``. So a skewed peer is grouped exactly as if its clock were right, at any
offset; only its place in the order moves. (The plausibility check compares times only within bounds wider
than any offset the DHT admits.)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError

from peerd.averaging.decisions import PENDING, Entry, decision_problem, leader, ordered, partition
from peerd.averaging.group import Group
from peerd.bounded import remember
from peerd.config import AveragingConfig
from peerd.errors import GroupFailed, PeerdError, ProtocolViolation
from peerd.swarm.clock import MAX_CLOCK_OFFSET, round_lifetime
from peerd.swarm.node import SwarmNode, now

logger = logging.getLogger(__name__)

POLL_INTERVAL = 0.1  # the first poll's delay; each next one is POLL_BACKOFF times longer, up to window/5
POLL_BACKOFF = 1.5
POLLS_PER_WINDOW = 5
# A follower's registration lands up to ~5 DHT request times after the leader's: the leader's progress record
# (stored beside its registration), the follower's progress pause (2) and read, then its own registration.
WINDOW_PER_LATENCY = 6.0
# Two peers' clocks may each be MAX_CLOCK_OFFSET off the peer they bootstrapped from, so twice that apart.
CLOCK_SPREAD = 2 * MAX_CLOCK_OFFSET
SKIP_SECONDS = 300.0  # a leader that did not decide leads no round of this peer's for this long
MAX_SKIPPED = 256
MAX_FALLBACKS = 3  # leaders a round falls back to after the first did not decide, before it gives up


def group_id(key: str, members: tuple[str, ...]) -> str:
    digest = hashlib.sha256("\n".join(members).encode()).hexdigest()[:12]
    return f"{key}/{digest}"


@dataclass
class _Round:
    """What this peer knows of one round key while it waits for the round's decision."""

    key: str
    registered_at: float  # our DHT time
    started: float  # our monotonic time
    window: float
    patience: float  # how long the first leader gets to decide, from `started`
    times: dict[str, float] = field(default_factory=dict)  # every registration read
    plausible: set[str] = field(default_factory=set)  # those whose time this peer believes: who may lead
    apart: dict[str, list[str]] = field(default_factory=dict)  # registrant -> whom it asks to be grouped apart from
    decisions: dict[str, list[list[str]]] = field(default_factory=dict)
    stalled: set[str] = field(default_factory=set)  # leaders this round no longer waits for or believes
    leading_since: dict[str, float] = field(default_factory=dict)  # candidate leader -> when we started waiting

    def deadline(self, candidate: str) -> float:
        """When ``candidate`` must have decided: the first leader by our patience, a fallback soon after it
        took over (its window is long over by then)."""
        since = self.leading_since.setdefault(candidate, time.monotonic())
        return max(self.started + self.patience, since + self.patience - self.window)


class Matchmaker:
    def __init__(self, swarm: SwarmNode, config: AveragingConfig, clock: Callable[[], float] = now,
                 apart: Callable[[], Sequence[str]] = list) -> None:
        """``clock``: this peer's DHT time (tests give peers skewed ones); ``apart``: the members this peer asks
        to be grouped apart from (``absences.Absences.apart``)."""
        self.swarm = swarm
        self.config = config
        self.clock = clock
        self.apart = apart
        self.skipped: OrderedDict[str, float] = OrderedDict()  # leader -> monotonic time its skip ends

    async def form_group(self, key: str, expected_peers: int, window: float | None = None) -> Group:
        """Registers for round ``key`` and returns this peer's group; ``expected_peers`` lets the leader
        close early once that many peers (this one included) have registered. ``window``: how long the leader
        waits for them at least (default ``averaging.matchmaking_window``); every peer of a round must pass the
        same.

        A peer that registered after the leader closed (or was left alone by it) gets one more round,
        ``<key>.late``, among the other latecomers, if ``expected_peers`` leaves room for any: on a busy swarm
        they are several, and averaging among themselves beats stepping alone."""
        base = self.config.matchmaking_window if window is None else window
        try:
            return await self._round(key, expected_peers, base)
        except _Late as late:
            if late.latecomers < 2:  # a latecomers' round would wait out its window alone
                raise GroupFailed(f"{late}; no other peer expected at this step was left out") from late
            try:
                return await self._round(f"{key}.late", late.latecomers, base)
            except GroupFailed as again:
                raise GroupFailed(f"{late}; then among the latecomers: {again}") from again

    async def _round(self, key: str, expected_peers: int, base: float) -> Group:
        me = self.swarm.peer_id
        limit = max(base, self.config.max_matchmaking_window)
        registered_at, started, apart = self.clock(), time.monotonic(), list(self.apart())
        lifetime = round_lifetime(self.config, base)
        await self.swarm.store(key, me, {"peer_id": me, "t": registered_at, "apart": apart},
                               registered_at + lifetime)
        window = self.window(base)  # after our own store, which the DHT's latency counts
        # the leader may have waited up to `limit`, measured from a registration before ours
        state = _Round(key, registered_at, started, window, limit + self.config.join_timeout + 2.0)
        target = max(2, min(expected_peers, self.config.target_group_size * 64))
        poll, fallbacks = POLL_INTERVAL, 0
        while True:
            await self._read(state)
            state.times.setdefault(me, registered_at)  # our own store may not be readable yet
            state.apart.setdefault(me, apart)
            state.plausible.add(me)
            groups = self._final(state)
            if groups is not None:
                break
            candidates = {p: state.times[p] for p in state.plausible
                          if p == me or p not in state.stalled and not self._skipping(p)}
            first = leader(candidates)
            if first != me and first not in state.leading_since and first != leader(
                    {p: state.times[p] for p in state.plausible if p not in state.stalled}):
                # we pass over an earlier registrant from a past round; `first` may not (it has seen no round of
                # that one fail), and decides only once it has waited that one out itself: a fallback's time
                state.leading_since[first] = started + state.patience
            if first == me and (time.monotonic() >= started + window or len(state.times) >= target):
                groups = await self._decide(state, lifetime)
                break
            # a leader whose decision is in waits for its registrations; `_final` refuses it past its deadline
            if first != me and first not in state.decisions and time.monotonic() > state.deadline(first):
                fallbacks += 1
                self._skip(first, f"{key}: leader {first} did not decide within "
                                  f"{time.monotonic() - started:.1f}s of this peer's registration")
                state.stalled.add(first)
                if fallbacks > MAX_FALLBACKS:
                    raise GroupFailed(f"no group decision for {key} within {time.monotonic() - started:.1f}s "
                                      f"({fallbacks} leaders did not decide: {sorted(state.stalled)})")
                continue
            # polling the DHT, which has no change notifications; every poll of every waiting peer is a lookup
            # that returns all registrations, so polls thin out while a round waits
            await asyncio.sleep(poll)
            poll = min(poll * POLL_BACKOFF, max(POLL_INTERVAL, window / POLLS_PER_WINDOW))
        # every expected peer that does not average in this round may come to the latecomers' one
        averaging = sum(len(members) for members in groups if len(members) >= self.config.min_group_size)
        latecomers = expected_peers - averaging
        for members in groups:
            if me in members:
                if len(members) < self.config.min_group_size:
                    raise _Late(f"group for {key} has {len(members)} member(s), below min_group_size", latecomers)
                ordered_members = tuple(members)
                return Group(group_id(key, ordered_members), ordered_members)
        raise _Late(f"{key}: registered too late, the leader's groups do not include this peer (its window "
                    f"was {window:.1f}s here)", latecomers)

    def window(self, base: float) -> float:
        """How long a leader waits for registrations: ``base``, or longer while this peer's DHT requests are
        slow (a registration takes a store, and the peers that learn of the round from progress records a read
        and a store more, to arrive), up to ``averaging.max_matchmaking_window``."""
        slow = WINDOW_PER_LATENCY * self.swarm.latency.median()
        return min(max(base, self.config.max_matchmaking_window), max(base, slow))

    async def _decide(self, state: _Round, lifetime: float) -> list[list[str]]:
        """Splits the plausible registrants this round still believes and publishes that (replacing our
        registration). Having passed over an earlier registrant, reads once more: a decision it published
        meanwhile is the one every reader takes, so it is ours too."""
        me = self.swarm.peer_id
        included = {p: state.times[p] for p in state.plausible if p not in state.stalled}
        groups = partition(ordered(included), state.apart, self.config.target_group_size,
                           self.config.min_group_size)
        await self.swarm.store(state.key, me, {"peer_id": me, "t": state.registered_at, "apart": state.apart[me],
                                               "groups": groups}, state.registered_at + lifetime + 1e-3)
        if leader({p: state.times[p] for p in state.plausible}) != me:
            state.decisions[me] = groups
            await self._read(state)
            return self._final(state) or groups
        return groups

    def _final(self, state: _Round) -> list[list[str]] | None:
        """The groups of the earliest registered peer that published a decision this peer can take, if any:
        the same for every reader of the same entries (two leaders publish only in a race, or when one took
        over from a leader that did not decide). A decision that fails its checks is refused, counted and
        its author skipped; one naming a registration not read yet waits for the next read, until its author's
        deadline."""
        for decider in ordered({p: state.times[p] for p in state.decisions if p in state.times}):
            if decider in state.stalled:
                continue
            problem = decision_problem(state.decisions[decider], state.times, state.apart,
                                       self.config.target_group_size, self.config.min_group_size)
            if problem is None:
                self.skipped.pop(decider, None)  # it decides again: no reason to pass it over
                return state.decisions[decider]
            if problem == PENDING and time.monotonic() <= state.deadline(decider):
                return None  # the earliest decision comes first, once its registrations are in
            state.stalled.add(decider)
            self._skip(decider, f"{state.key}: refused the decision of {decider}: {problem}")
            self.swarm.drop("bad_decision", ProtocolViolation(f"matchmaking decision of {decider} under "
                                                              f"{state.key}: {problem}", peer_id=decider))
        return None

    def _skipping(self, peer: str) -> bool:
        until = self.skipped.get(peer)
        if until is None:
            return False
        if until < time.monotonic():
            del self.skipped[peer]
            return False
        return True

    def _skip(self, peer: str, why: str) -> None:
        logger.warning("%s; it leads none of this peer's rounds for %.0fs", why, SKIP_SECONDS)
        remember(self.skipped, peer, time.monotonic() + SKIP_SECONDS, MAX_SKIPPED)

    async def _read(self, state: _Round) -> None:
        """Reads the round's entries (each signed by the peer its subkey names: the swarm node checked that)
        into ``state``: registration times within what this peer finds plausible, and decisions."""
        try:
            found = await self.swarm.read_subkeys(state.key)
        except PeerdError as e:
            logger.debug("Matchmaking read of %s failed: %s", state.key, e)
            return
        limit = max(self.config.matchmaking_window, self.config.max_matchmaking_window)
        earliest = state.registered_at - (limit + self.config.join_timeout + CLOCK_SPREAD + 1.0)
        latest = self.clock() + CLOCK_SPREAD + 1.0
        for subkey, value in found.items():
            try:
                entry = Entry.model_validate(value)
            except ValidationError as e:
                self.swarm.drop("malformed", ProtocolViolation(
                    f"malformed matchmaking entry {subkey[:140]!r} under {state.key}: {e.errors()[0]['msg']}",
                    peer_id=subkey[-128:]))
                continue
            # an implausible time still makes its author a registrant (a leader may group it: its bounds differ
            # from ours), but never the leader, and never in our own decision
            if earliest <= entry.t <= latest:
                state.plausible.add(subkey)
            elif subkey not in state.times:  # counted once per round
                self.swarm.drop("implausible_time", ProtocolViolation(
                    f"matchmaking entry of {subkey} under {state.key} registered at {entry.t:.1f}, outside "
                    f"{earliest:.1f}..{latest:.1f} on this peer's clock", peer_id=subkey))
            state.times[subkey] = entry.t
            state.apart[subkey] = entry.apart
            if entry.groups is not None:
                state.decisions[subkey] = entry.groups


class _Late(GroupFailed):
    """This peer is in no group of a round, or alone in one; ``latecomers``: the peers to expect in the
    latecomers' round (those expected in this one that do not average in it, itself included)."""

    def __init__(self, message: str, latecomers: int) -> None:
        super().__init__(message)
        self.latecomers = latecomers
