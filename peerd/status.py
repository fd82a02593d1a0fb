"""What a running daemon shows of itself: the peer record it publishes in the DHT, its ready line and its
``/status`` document, read from its components' read-only views.

The daemon hands itself over as a :class:`Running`: this module reads those parts and changes none of them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Protocol

from peerd import __version__
from peerd.config import PeerdConfig
from peerd.control.server import ControlServer
from peerd.swarm.node import SwarmNode, now
from peerd.swarm.presence import Presence
from peerd.swarm.records import PROTOCOL_VERSION, Capabilities, PeerRecord, PeerState
from peerd.wire.guard import StreamGuard
from peerd.wire.membership import Membership

if TYPE_CHECKING:
    from peerd.experts import ExpertClient, ExpertServer
    from peerd.training.trainer import CollaborativeTrainer

__all__ = ["Running", "experts_section", "peer_record", "ready_line", "roles", "status_document"]


class Running(Protocol):
    """The parts of a daemon these views read; a component is None until started (or when not configured)."""

    config: PeerdConfig
    state: PeerState
    started_at: float
    membership: Membership
    swarm: SwarmNode | None
    presence: Presence | None
    guard: StreamGuard | None
    control: ControlServer | None
    trainer: CollaborativeTrainer | None
    experts: ExpertServer | None
    expert_client: ExpertClient | None


def roles(peer: Running) -> list[str]:
    named: list[str] = list(peer.config.swarm.roles)
    if peer.experts is not None and "expert_host" not in named:
        named.append("expert_host")
    return named


def peer_record(peer: Running) -> PeerRecord:
    assert peer.swarm is not None
    training = peer.trainer is not None and peer.state is not PeerState.LEAVING
    throughput = round(peer.trainer.report.samples_per_second, 3) if peer.trainer is not None and training else None
    return PeerRecord(
        peer_id=peer.swarm.peer_id,
        software_version=__version__,
        protocol_version=PROTOCOL_VERSION,
        roles=roles(peer),
        state=peer.state,
        maddrs=peer.swarm.visible_maddrs(),
        capabilities=Capabilities(throughput=throughput, experts=peer.experts.uids if peer.experts else []),
        started_at=peer.started_at,
        updated_at=max(now(), peer.started_at),
        peers_seen=peer.presence.view.seen_count if peer.presence is not None else None,
    )


def ready_line(peer: Running) -> dict[str, Any]:
    """The JSON line `peerd start` prints once the peer is up: how to reach it and its control endpoint."""
    assert peer.swarm is not None and peer.control is not None
    return {
        "event": "ready",
        "peer_id": peer.swarm.peer_id,
        "maddrs": peer.swarm.visible_maddrs(),
        "control": peer.control.url,
        "run_name": peer.config.run_name,
        "pid": os.getpid(),
    }


def experts_section(peer: Running) -> dict[str, Any] | None:
    """``calls``/``errors``/``latency`` (both sides, for /metrics); ``server``: this host's experts (calls,
    tokens, latency, errors, updates); ``client``: the experts this peer's model called (latency, failures)
    and its MoE layers (fallback tokens). See ``peerd.experts.stats.status_section``."""
    if peer.experts is None and peer.expert_client is None:
        return None
    from peerd.experts.stats import status_section

    return status_section(peer.experts, peer.expert_client)


async def status_document(peer: Running) -> dict[str, Any]:
    """The ``/status`` document (``peerd status`` renders it; the metrics are computed from it)."""
    assert peer.swarm is not None and peer.presence is not None
    peers, peers_read_age, error = await peer.presence.peers()
    dropped, node = await peer.swarm.dht_counts()
    return {
        "peer_id": peer.swarm.peer_id,
        "run_name": peer.config.run_name,
        "software_version": __version__,
        "state": peer.state.value,
        "maddrs": peer.swarm.visible_maddrs(),
        "uptime": round(now() - peer.started_at, 2),
        "roles": roles(peer),
        "pid": os.getpid(),
        "peers": peers,
        "peers_read_age": peers_read_age,  # seconds since the read of the records in `peers` began
        "dht_error": error,
        "view": peer.presence.view.status(),
        # the median of this peer's recent DHT stores and reads: matchmaking windows and progress reads
        # stretch with it
        "dht_request_seconds": round(peer.swarm.latency.median(), 4),
        "records_dropped": dropped,
        # DHT requests cut short by the wait bound (a peer answering far slower than the typical one)
        "dht_requests_cut": node and node["requests_cut"],
        # times this DHT node kept a peer out of its routing table: in a private swarm, one that proved no membership
        "dht_peers_kept_out": node and node["peers_kept_out"],
        # finds and stores refused for asking about more keys at once than their sender may, or for storing a whole
        # dictionary from a peer not (yet) admitted
        "dht_requests_refused": node and node["requests_refused"],
        "training": peer.trainer.report.as_dict() if peer.trainer is not None else None,
        "experts": experts_section(peer),
        "membership": peer.guard.status() if peer.guard is not None else {"mode": peer.membership.describe()},
        "reachability": peer.swarm.reach.status(),
    }
