"""How long this DHT node waits for one peer's answer: a bound set by how fast the other peers answer.

A lookup asks up to ``swarm.lookup_beam`` nodes, and peerd reads every key for its latest value, so a lookup
ends only when every node it asked has answered or timed out. hivemind gives each request one fixed timeout,
the whole lookup's (``swarm.request_timeout``): a peer that answers just under it makes every lookup that asks
it last about as long as a lookup may, and never counts as failing.

Here a request waits at most ``swarm.dht_wait_ratio`` times the typical peer's answer time, and at least
``swarm.dht_wait_floor`` seconds (never more than ``swarm.request_timeout``). The typical time is a
:class:`~peerd.bounded.PeerMedians` over the answers this node got: a peer has one vote however often it is
asked, so a slow one does not raise the bound it is held to. An answer that does come in time but later than
``dht_wait_ratio`` times the typical (and 0.1 s), from a peer whose median answer is as late, or whose earlier
answers took as long on average, does not count either: a peer answering just under the floor is slow as a rule,
not once, and so is one late in only some of its answers (two in five, in the test) but by enough to add as much
to its requests on average. Either is a failure to hivemind, whose blacklist then skips that peer in lookups for
5 s, doubling while it stays slow (and stores, which hivemind sends to blacklisted peers too, skip it here); an
honest peer that was slow for a moment is asked again after 5 s and forgiven once its answers are in time on
average again (six in time after one 0.9 s late, at the test's typical 17 ms). Until then an answer in time does
not forgive it (hivemind's blacklist forgets every ban on one): a peer late in two answers of five would be
banned for 5 s again and again, and delay a lookup every few seconds.

hivemind builds the node's ``DHTProtocol`` itself, with no way to pass another class; :func:`guard_node`
switches the running protocol's class to one that times its answers and admits only members to its routing
table (``admission.py``), where the node runs (``run_coroutine``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Sequence
from typing import Any

from hivemind.dht.node import Blacklist, DHTNode
from hivemind.p2p import PeerID

from peerd.bounded import PeerMedians
from peerd.swarm.admission import Admission, AdmittingProtocol, bound_requests
from peerd.swarm.validator import SignedRecordValidator
from peerd.wire.membership import Membership

__all__ = ["WaitBound", "guard_node", "node_bookkeeping"]

QUICK = 0.1  # seconds: an answer this fast is never too slow, however fast the typical peer answers
RULE = 3  # answers of a peer before its median is its rule: a first answer may have waited for a dial


class WaitBound:
    """The typical peer's answer time, the wait it sets, and which answers came too late to count."""

    def __init__(self, ratio: float | None, floor: float, ceiling: float) -> None:
        """``ratio``: times the typical answer time a request may wait, and an answer may take (None: always
        ``ceiling``, and every answer counts)."""
        self.ratio = ratio
        self.floor = min(floor, ceiling)
        self.ceiling = ceiling
        self.cut = 0  # requests cut short under the ceiling, and answers that came too late
        self._answers = PeerMedians()

    def wait(self) -> float:
        """How long the next request may wait for its answer."""
        typical = self._answers.typical()
        if self.ratio is None or typical is None:
            return self.ceiling
        return min(self.ceiling, max(self.floor, self.ratio * typical))

    def answered(self, peer: str, seconds: float, wait: float, ok: bool) -> bool:
        """A request to ``peer`` that could wait ``wait`` ended after ``seconds``, answered (``ok``) or not;
        whether its answer counts. One that came after ``ratio`` times the typical peer's answer time, from a
        peer whose median answer time is as slow, or whose earlier answers took as long on average, does not: that
        peer answers slowly, not once. The mean bounds what a peer late in only some of its answers adds to a
        request on average (about ``late``); the earlier answers', so that one slow moment is not its own proof."""
        if not ok:
            if seconds >= wait and wait < self.ceiling:
                self.cut += 1
            return False
        late = self._late()
        earlier = self._answers.mean(peer) if seconds > late else None  # before this answer joins them
        self._answers.observe(peer, seconds)
        if seconds > late and self._answers.count(peer) >= RULE and max(
                self._answers.median(peer) or 0.0, earlier or 0.0) > late:
            self.cut += 1
            return False
        return True

    def slow(self, peer: str) -> bool:
        """Whether ``peer`` answers late as a rule: the median or the mean of its kept answers (``RULE`` of them at
        least) is later than ``ratio`` times the typical peer's answer time (and 0.1 s)."""
        if self._answers.count(peer) < RULE:
            return False
        late = self._late()
        return max(self._answers.median(peer) or 0.0, self._answers.mean(peer) or 0.0) > late

    def _late(self) -> float:
        typical = self._answers.typical()
        return max(QUICK, self.ratio * typical) if self.ratio is not None and typical is not None else math.inf


class _PatientBlacklist(Blacklist):  # type: ignore[misc]  # hivemind ships no type information
    """hivemind's blacklist, except that an answer in time does not forgive a peer slow as a rule
    (:meth:`WaitBound.slow`): its next late answer bans it twice as long as the last, not 5 s again. ``bound`` is
    set when the class is switched."""

    bound: WaitBound

    def register_success(self, peer: PeerID) -> None:
        if not self.bound.slow(str(peer)):
            super().register_success(peer)


class _BoundedProtocol(AdmittingProtocol):
    """hivemind's protocol, admitting members only and waiting as the bound says; ``bound`` and ``blacklist``
    (the node's) are set when the class is switched."""

    bound: WaitBound
    blacklist: Blacklist

    @property
    def wait_timeout(self) -> float:
        return self.bound.wait()

    @wait_timeout.setter
    def wait_timeout(self, seconds: float) -> None:
        """hivemind's constructor sets its fixed timeout; the bound's ceiling already holds it."""

    async def call_find(self, peer: PeerID, keys: Collection[Any]) -> Any:
        wait, started = self.bound.wait(), time.monotonic()
        found = await super().call_find(peer, keys)
        return found if self._counts(peer, started, wait, found is not None) else None

    async def call_store(self, peer: PeerID, keys: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        if peer in self.blacklist:  # hivemind skips a blacklisted peer in lookups, not in stores
            return None
        wait, started = self.bound.wait(), time.monotonic()
        stored = await super().call_store(peer, keys, *args, **kwargs)
        return stored if self._counts(peer, started, wait, stored is not None) else None

    def _counts(self, peer: PeerID, started: float, wait: float, ok: bool) -> bool:
        if self.bound.answered(str(peer), time.monotonic() - started, wait, ok):
            return True
        self.blacklist.register_failure(peer)  # skipped for 5 s, doubling while it stays slow
        return False


async def guard_node(ratio: float | None, floor: float, _dht: object, node: DHTNode) -> None:
    """Run where the DHT node runs (``run_coroutine``), once it has bootstrapped: its routing table admits only
    members (the validator's proofs) and its requests wait as a :class:`WaitBound` says (with ``ratio`` None,
    as hivemind has them: ``request_timeout`` each)."""
    protocol = node.protocol
    validators = getattr(protocol.record_validator, "_validators", [])  # hivemind's CompositeValidator
    validator = next((v for v in validators if isinstance(v, SignedRecordValidator)), None)
    bound = WaitBound(ratio, floor, float(protocol.__dict__.get("wait_timeout", floor)))
    protocol.__class__ = _BoundedProtocol
    protocol.bound = bound
    protocol.admission = validator.admission if validator is not None else Admission(Membership())  # open
    bound_requests(protocol, protocol.admission)
    node.blacklist.__class__ = _PatientBlacklist
    node.blacklist.bound = bound
    protocol.blacklist = node.blacklist


async def node_bookkeeping(_dht: object, node: DHTNode) -> dict[str, int]:
    """Run where the DHT node runs: the requests its bound cut short (and answers that came too late to count),
    the times it kept a peer out of its routing table, and the requests it refused (``admission.bound_requests``)."""
    protocol = node.protocol
    bound, admission = getattr(protocol, "bound", None), getattr(protocol, "admission", None)
    return {"requests_cut": bound.cut if isinstance(bound, WaitBound) else 0,
            "peers_kept_out": admission.kept_out if admission is not None else 0,
            "requests_refused": admission.refused if admission is not None else 0}
