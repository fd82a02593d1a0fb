"""This peer's place in the swarm: hivemind's DHT (Kademlia over libp2p/p2pd) plus the peer-record API.

A trainer runs hivemind's DHT in a child process that owns p2pd (``process.py`` detaches it and ties it to
our lifetime); a light peer runs the same DHT node on its own event loop (``inprocess.py``); ``bootstrap.py``
starts either. Every value stored is signed and every value read is verified (``signing.py``).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hivemind.utils.timed_storage import get_dht_time

from peerd.config import SwarmConfig
from peerd.errors import DaemonError, IdentityError, ProtocolViolation, TransportError
from peerd.log import RateLimitedLog
from peerd.swarm.bootstrap import short_error, start_with_retries
from peerd.swarm.clock import record_lifetimes
from peerd.swarm.identity import generate_identity
from peerd.swarm.inprocess import InProcessDHT
from peerd.swarm.latency import LatencyWindow
from peerd.swarm.reach import Reachability, free_loopback_port
from peerd.swarm.records import PeerRecord, parse_record
from peerd.swarm.signing import RecordLifetimes, RecordSigner, RecordVerifier, key_id
from peerd.swarm.stragglers import node_bookkeeping
from peerd.swarm.validator import node_drop_counts
from peerd.swarm.view import rebootstrap_node
from peerd.wire.membership import Membership

if TYPE_CHECKING:
    from hivemind.dht.node import DHTNode

    from peerd.swarm.process import IsolatedDHT

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeenPeer:
    record: PeerRecord
    expires_at: float


async def node_counts(dht: object, node: DHTNode) -> tuple[dict[str, int], dict[str, int]]:
    """Run where the DHT node runs (``run_coroutine``), in one round trip: its refused records, by reason, and
    its other counts (``stragglers.node_bookkeeping``)."""
    return await node_drop_counts(dht, node), await node_bookkeeping(dht, node)


class SwarmNode:
    """Owns the DHT (and p2pd); publishes this peer's signed records and reads everyone else's, verified.

    Every value goes through :meth:`store` (signed with this peer's identity key) and :meth:`read_entries`
    (only values whose signature, signer and membership check out; see ``peerd.swarm.signing``).
    """

    def __init__(self, config: SwarmConfig, run_name: str, dht: IsolatedDHT | InProcessDHT, signer: RecordSigner,
                 membership: Membership, reach: Reachability, lifetimes: RecordLifetimes,
                 ephemeral_dir: Path | None = None) -> None:
        self.config = config
        self.reach = reach
        self.run_name = run_name
        self.dht = dht
        self.peer_id = str(dht.peer_id)
        self.signer = signer
        self.membership = membership
        self.verifier = RecordVerifier(membership, lifetimes)
        self._ephemeral_dir = ephemeral_dir
        self._last_expiration = 0.0
        self._log_dropped = RateLimitedLog(logger)  # status requests read the DHT often: one line a minute per peer
        self.latency = LatencyWindow()  # of stores and reads: matchmaking sizes its window by it

    @property
    def records_key(self) -> str:
        return f"{self.run_name}.peers"

    @classmethod
    async def create(cls, config: SwarmConfig, run_name: str, membership: Membership | None = None,
                     in_process: bool = False, lifetimes: RecordLifetimes | None = None) -> SwarmNode:
        """Starts p2pd and the DHT, retrying the bootstrap with backoff; raises BootstrapError when done.

        ``in_process``: the DHT runs on this event loop (``inprocess.py``, for a light peer) rather than in
        hivemind's child process. ``lifetimes``: how far ahead values may expire, by key
        (``clock.record_lifetimes`` of the whole config; default: of ``config`` and the other sections' defaults).

        Without ``swarm.identity_path`` the peer gets a fresh key in a private temporary directory (removed
        at shutdown): the daemon needs the key itself, to sign its records.
        """
        membership = membership or Membership()
        lifetimes = lifetimes or record_lifetimes(run_name, config)
        ephemeral_dir = None
        identity_path = config.identity_path
        if identity_path is None:
            ephemeral_dir = Path(tempfile.mkdtemp(prefix="peerd-identity-"))  # mode 0700
            identity_path = ephemeral_dir / "identity.key"
        try:
            fresh = not identity_path.exists()
            if fresh:  # as hivemind would: a configured path without a key gets a new one
                generate_identity(identity_path)
            try:
                signer = RecordSigner(identity_path.read_bytes(), membership)
            except OSError as e:
                raise IdentityError(f"cannot read identity file {identity_path}: {e.strerror or e}",
                                    path=identity_path) from e
            metrics_port = config.relay.metrics_port or free_loopback_port()
            dht = await start_with_retries(config, identity_path, fresh, membership, lifetimes, metrics_port,
                                           in_process)
            if str(dht.peer_id) != signer.peer_id:
                await dht.close()
                raise DaemonError(f"p2pd runs as {dht.peer_id} but the identity key is {signer.peer_id}")
        except BaseException:
            if ephemeral_dir is not None:
                shutil.rmtree(ephemeral_dir, ignore_errors=True)
            raise
        return cls(config, run_name, dht, signer, membership, Reachability(config, metrics_port), lifetimes,
                   ephemeral_dir)

    def visible_maddrs(self) -> list[str]:
        """Our addresses as of the last reachability refresh (a relay slot adds a relayed one later)."""
        return self.reach.addresses or [str(m) for m in self.dht.get_visible_maddrs()]

    def alive(self) -> bool:
        return bool(self.dht.is_alive())

    async def publish(self, record: PeerRecord) -> None:
        """Stores our record with a fresh expiration. Expirations only grow: the DHT keeps the newest."""
        now = get_dht_time()
        expiration = max(now + self.config.record_ttl, self._last_expiration + 1e-3)
        await self._store(record, expiration)

    async def publish_leaving(self, record: PeerRecord) -> None:
        """Replaces our record with a ``leaving`` one that expires when the current one would have.

        hivemind keeps the value with the latest expiration per subkey, so the leaving record must expire
        (just) after the last one to replace it; it cannot be deleted outright.
        """
        await self._store(record, max(self._last_expiration, get_dht_time()) + 1e-3)

    async def _store(self, record: PeerRecord, expiration: float) -> None:
        await self.store(self.records_key, self.peer_id, record.to_wire(), expiration)
        self._last_expiration = expiration

    async def store(self, key: str, subkey: str, payload: dict[str, Any], expiration: float) -> bool:
        """Signs ``payload`` (JSON-able, naming this peer as ``peer_id``) and stores it under ``key``/``subkey``
        until ``expiration`` (DHT time); bounded by request_timeout."""
        value = self.signer.envelope(key, subkey, payload, expiration)
        future = self.dht.store(key, value, expiration, subkey=subkey, return_future=True,
                                beam_size=self.config.lookup_beam)
        try:
            with self.latency.timing():
                ok = bool(await asyncio.wait_for(asyncio.wrap_future(future), self.config.request_timeout))
        except TimeoutError as e:
            raise TransportError(f"storing {key} timed out after {self.config.request_timeout}s") from e
        if not ok:
            logger.debug("DHT store of %s was not accepted by any node (alone in the swarm?)", key)
        return ok

    async def read_entries(self, key: str) -> dict[str, tuple[object, float]]:
        """Unexpired ``subkey -> (payload, expiration)`` under ``key`` whose signature, signer and membership
        check out (others are counted and dropped); payloads are otherwise unvalidated peer data."""
        future = self.dht.get(key, latest=True, return_future=True, beam_size=self.config.lookup_beam)
        try:
            with self.latency.timing():
                found = await asyncio.wait_for(asyncio.wrap_future(future), self.config.request_timeout)
        except TimeoutError as e:
            raise TransportError(f"reading {key} timed out after {self.config.request_timeout}s") from e
        if found is None or not isinstance(found.value, dict):
            return {}
        current = get_dht_time()
        entries: dict[str, tuple[object, float]] = {}
        key_bytes = key_id(key)
        for subkey, entry in found.value.items():
            expiration = getattr(entry, "expiration_time", 0.0)
            if not (isinstance(subkey, str) and isinstance(expiration, float) and expiration >= current):
                continue
            try:
                opened = self.verifier.open(key_bytes, subkey, getattr(entry, "value", None), expiration)
            except ProtocolViolation as e:
                self._log_dropped(str(e.context.get("peer_id", subkey)), logging.WARNING,
                                  "Dropping invalid record: %s", e)
                continue
            entries[subkey] = (opened.payload, expiration)
        return entries

    def drop(self, reason: str, error: ProtocolViolation) -> None:
        """Counts and logs a record a reader refused after its signature checked out (e.g. a bad payload)."""
        self.verifier.count(reason)
        self._log_dropped(str(error.context.get("peer_id", "unknown")), logging.WARNING, "Dropping invalid record: %s",
                          error)

    async def dht_counts(self) -> tuple[dict[str, int], dict[str, int] | None]:
        """Records refused, by reason (by this daemon's readers plus its DHT node's stores and answers), and the
        DHT node's other counts: requests its wait bound cut short (``stragglers.py``), times its routing table
        kept a peer out and requests it refused (``admission.py``); None when it could not be read."""
        counts = self.verifier.counts()
        try:
            future = self.dht.run_coroutine(node_counts, return_future=True)
            child, other = await asyncio.wait_for(asyncio.wrap_future(future), self.config.request_timeout)
        except (TimeoutError, OSError, RuntimeError) as e:
            logger.debug("Could not read the DHT node's counts: %r", e)
            return counts, None
        for reason, count in child.items():
            counts[reason] = counts.get(reason, 0) + count
        return counts, {name: int(count) for name, count in other.items()}

    async def read_subkeys(self, key: str) -> dict[str, object]:
        return {subkey: value for subkey, (value, _) in (await self.read_entries(key)).items()}

    async def read_peers(self) -> list[SeenPeer]:
        """All valid, unexpired records of this run, ours included, sorted by peer id."""
        peers = []
        for subkey, (value, expiration) in (await self.read_entries(self.records_key)).items():
            try:
                peers.append(SeenPeer(parse_record(subkey, value), expiration))
            except ProtocolViolation as e:
                self.drop("malformed", e)
        return sorted(peers, key=lambda p: p.record.peer_id)

    async def rebootstrap(self, others: Sequence[str] = ()) -> int:
        """Re-dials the initial peers (and ``others``: multiaddrs with /p2p/) and looks up our neighbourhood
        again, in the running DHT (``view.py``); returns how many initial peers answered."""
        timeout = self.config.request_timeout
        coroutine = partial(rebootstrap_node, list(self.config.initial_peers), list(others), self.records_key,
                            timeout)
        future = self.dht.run_coroutine(coroutine, return_future=True)
        try:
            return int(await asyncio.wait_for(asyncio.wrap_future(future), timeout * 4))
        except (TimeoutError, OSError, RuntimeError) as e:
            logger.warning("Re-bootstrap did not finish: %s", short_error(e))
            return 0

    async def shutdown(self) -> None:
        started = time.monotonic()
        try:
            await self.dht.close()
        finally:
            if self._ephemeral_dir is not None:
                shutil.rmtree(self._ephemeral_dir, ignore_errors=True)
        logger.info("DHT and p2pd stopped in %.2fs", time.monotonic() - started)


def now() -> float:
    return float(get_dht_time())


__all__: Sequence[str] = ["SeenPeer", "SwarmNode", "now"]
