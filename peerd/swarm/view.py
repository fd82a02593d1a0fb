"""Is this peer's view of the swarm whole? Split-brain detection at run time, and the re-bootstrap that heals it.

hivemind's users have seen peers with the same initial peers form separate DHTs (hivemind#624: four peers, two
DHTs of two), and a peer whose routing table misses the nodes that hold ``<run>.peers`` reads a partial set of
records. Neither fails anything: the peer just trains with fewer peers. So every few seconds the daemon
reads the records and :class:`ViewWatch` compares what it sees with two kinds of evidence:

- **what others report**: each record carries ``peers_seen``, the size of its publisher's view. A peer that
  sees far fewer (under ``SHORTFALL`` of the largest report, and at least ``MIN_GAP`` fewer) misses some.
- **its initial peers**: they answered when this peer joined. If none of their records is visible while one of
  them still answers a ping, this peer is likely in another DHT than they are. (An initial peer that is a bare
  hivemind DHT node, publishing no record, looks the same; the status says which evidence was used.)

The check runs every ``CHECK_PERIOD`` seconds (or every supervision tick, if those are longer). A suspicion
must hold for ``CONFIRM`` checks in a row (records spread within a refresh period or two). Then the
daemon logs a WARNING, shows it in status (``view``) and re-bootstraps without restarting: it re-dials the
initial peers and the peer reporting the largest view (its record has its addresses), pings them into the routing
table and looks up its own neighbourhood and the records key again
(:func:`rebootstrap_node`, run where the DHT node runs), then re-publishes at once. Re-bootstraps back off
(doubling up to ``MAX_BACKOFF`` seconds) while the view stays partial.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hivemind.dht import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from multiaddr import Multiaddr

from peerd.wire import p2pd_control

logger = logging.getLogger(__name__)

SHORTFALL = 0.75  # a view smaller than this fraction of the largest reported one is partial ...
MIN_GAP = 2  # ... if it also misses at least this many peers (small swarms: one record may just be late)
CONFIRM = 3  # consecutive checks a suspicion must hold before the peer warns and re-bootstraps
MAX_BACKOFF = 300.0  # seconds between re-bootstraps at most, while the view stays partial
# Seconds between checks at least. A read of all records costs O(swarm size) bytes from each node asked, which
# at every status tick would add up to a large share of a peer's traffic; and a split brain is a lasting state,
# not a passing one.
CHECK_PERIOD = 10.0


@dataclass(frozen=True)
class Verdict:
    partial: bool
    seen: int  # records in view, ours included
    expected: int  # the largest view any visible peer reports (at least ours)
    reason: str | None  # why the view looks partial (None: it looks whole)
    reporter: str | None = None  # the peer reporting the largest view, when that is the evidence


def judge(seen: Iterable[str], reported: Mapping[str, int | None], initial_peers: Iterable[str], own_id: str,
          initial_alive: bool) -> Verdict:
    """One tick's verdict: ``seen``: peer ids in view (ours included); ``reported``: each one's ``peers_seen``
    (None: an older peer that does not say); ``initial_alive``: an initial peer answered our last ping."""
    seen_ids = set(seen) | {own_id}
    counts = [count for count in reported.values() if count is not None]
    expected = max([len(seen_ids), *counts])
    if len(seen_ids) < SHORTFALL * expected and expected - len(seen_ids) >= MIN_GAP:
        best = max(reported, key=lambda peer: reported[peer] or 0)
        return Verdict(True, len(seen_ids), expected,
                       f"this peer sees {len(seen_ids)} peers, {best} reports {expected}", best)
    others = set(initial_peers) - {own_id}
    if others and initial_alive and not others & seen_ids:
        return Verdict(True, len(seen_ids), expected,
                       "no initial peer's record is visible although one answers: another DHT?")
    return Verdict(False, len(seen_ids), expected, None)


class ViewWatch:
    """Verdicts over time: debounces them, decides when to re-bootstrap, keeps what status shows."""

    def __init__(self, initial_peers: Iterable[str], own_id: str, period: float) -> None:
        # swarm.initial_peers are validated to end in /p2p/<peer id>
        self.initial_ids = [address.rsplit("/p2p/", 1)[-1] for address in initial_peers]
        self.own_id = own_id
        self.period = period  # the supervision period: the first backoff
        self.verdict = Verdict(False, 1, 1, None)
        self.seen_count: int | None = None  # what our record reports as peers_seen (None until the first read)
        self.initial_alive = True  # they answered at bootstrap
        self.rebootstraps = 0
        self._streak = 0
        self._backoff = period
        self._next_rebootstrap = 0.0
        self._warned = False
        self._next_check = 0.0
        self._whole = 0  # consecutive checks that found the view whole
        self.read_seconds: deque[float] = deque(maxlen=200)  # durations of the DHT reads of all records

    def due(self, now: float) -> bool:
        """True once per ``CHECK_PERIOD`` (``now``: monotonic seconds): time to read the records and observe."""
        if now < self._next_check:
            return False
        self._next_check = now + CHECK_PERIOD
        return True

    def observe(self, seen: Iterable[str], reported: Mapping[str, int | None], now: float) -> bool:
        """Takes one tick's view; True when the daemon should re-bootstrap now."""
        verdict = judge(seen, reported, self.initial_ids, self.own_id, self.initial_alive)
        self.seen_count = verdict.seen
        return self._take(verdict, now)

    def failed_read(self, error: str, now: float) -> bool:
        """Takes a check whose read of the records failed; True when the daemon should re-bootstrap now.

        A peer that cannot read the records sees nobody, however many records exist: an overloaded or cut-off
        peer is the case this check is for, so failures count like a partial view (the streak still
        debounces one slow read)."""
        return self._take(Verdict(True, self.verdict.seen, self.verdict.expected,
                                  f"its read of the records failed: {error}"), now)

    def _take(self, verdict: Verdict, now: float) -> bool:
        self.verdict = verdict
        if not self.verdict.partial:
            if self._warned:
                logger.info("The view of the swarm is whole again: %d peers", self.verdict.seen)
            self._streak, self._warned = 0, False
            self._whole += 1
            if self._whole >= CONFIRM:  # only whole for a while: a flapping view (overload) keeps its backoff
                self._backoff = self.period
            return False
        self._whole = 0
        self._streak += 1
        if self._streak < CONFIRM or now < self._next_rebootstrap:
            return False
        logger.warning("Partial view of the swarm (split brain?): %s; re-bootstrapping from the initial peers "
                       "(%d before)", self.verdict.reason, self.rebootstraps)
        self._warned = True
        self.rebootstraps += 1
        self._next_rebootstrap = now + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF)
        return True

    def rebootstrapped(self, answered: int) -> None:
        """``answered``: initial peers that answered the re-bootstrap's pings."""
        self.initial_alive = answered > 0
        if not answered and self.initial_ids:
            logger.info("No initial peer answered the re-bootstrap; they may have left the swarm")

    def status(self) -> dict[str, Any]:
        reads = sorted(self.read_seconds)
        return {
            "seen": self.verdict.seen,
            "expected": self.verdict.expected,
            "partial": self.verdict.partial and self._streak >= CONFIRM,
            "reason": self.verdict.reason,
            "rebootstraps": self.rebootstraps,
            "read_seconds": {
                "count": len(reads),
                "p50": round(statistics.median(reads), 4) if reads else None,
                "p99": round(reads[min(len(reads) - 1, int(0.99 * len(reads)))], 4) if reads else None,
            },
        }


async def rebootstrap_node(initial_peers: list[str], others: list[str], records_key: str, timeout: float,
                           _dht: object, node: DHTNode) -> int:
    """Run where the DHT node runs (``run_coroutine``): what ``DHTNode.create`` does with initial peers, again.

    Dials each initial peer and each of ``others`` (addresses may have left p2pd's peer store since the start),
    pings it into the routing table (and us into its), then looks up our own neighbourhood and the records key
    so the next store and get reach the nodes that hold them. Returns how many initial peers answered.
    """

    async def reach(address: str) -> bool:
        maddr = Multiaddr(address)
        peer = PeerID.from_base58(maddr["p2p"])
        try:
            # DHTNode.create dials through p2pd's bootstrap flag; a running node has only the control socket
            await asyncio.wait_for(p2pd_control.connect(node.p2p, peer, [maddr.decapsulate(f"/p2p/{peer}")]),
                                   timeout)
        except Exception as e:  # noqa: BLE001 - any failure to dial means: this one did not answer
            logger.debug("Re-bootstrap: could not dial %s: %r", address, e)
        return await node.protocol.call_ping(peer) is not None

    answered = await asyncio.gather(*(reach(address) for address in [*initial_peers, *others]))
    await asyncio.wait_for(node.find_nearest_nodes([node.node_id, DHTID.generate(source=records_key)]),
                           timeout * 2)
    return sum(answered[:len(initial_peers)])
