"""Sections for the peer itself: how it joins the swarm, its control endpoint, its logs."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from peerd.config.base import Section
from peerd.config.relay import RelayConfig

DEFAULT_CONTROL_PORT = 7710
Role = Literal["trainer", "expert_host", "bootstrap", "observer"]  # what a peer advertises in its record


def _default_roles() -> list[Role]:
    return ["trainer"]


class StreamLimits(Section):
    """What one peer, member or not, can make this daemon hold for the streams it opens to us.

    A stream from a peer that has not yet proven membership to this one waits for its handshake in a small
    pool of its own (``max_unproven_streams``, ``unproven_handshake_timeout``) and takes a member's slot
    (``max_streams``) only once its proof checked out, so strangers cannot take members' slots."""

    handshake_timeout: float = Field(
        default=10.0, gt=0, description="Seconds a stream's membership handshake may take, either side, for a "
        "peer that proved its membership to this one before.")
    max_streams_per_peer: int = Field(
        default=64, ge=1, description="Streams one member may have open to us at once (all protocols); more "
        "are refused as busy.")
    max_streams: int = Field(default=1024, ge=1, description="Inbound streams of members open at once.")
    max_unproven_streams_per_peer: int = Field(
        default=4, ge=1, description="Streams one peer that has not proven membership to us yet may have "
        "waiting for their handshake at once; more are refused as busy before anything is read.")
    max_unproven_streams: int = Field(
        default=64, ge=1, description="Streams of all such peers waiting for their handshake at once.")
    unproven_handshake_timeout: float = Field(
        default=5.0, gt=0, description="Seconds a peer that has not proven membership to us yet has to finish "
        "a stream's handshake.")
    disconnect_unproven: bool = Field(
        default=True, description="Disconnect a peer that has not proven membership to us when it sends a wrong "
        "proof, or when max_unproven_refusals of its streams were refused: every stream reaches this daemon "
        "through p2pd before it can be refused, and closing the connection ends all of that peer's streams at "
        "once; it must reconnect to try again.")
    max_unproven_refusals: int = Field(
        default=16, ge=1, description="Streams of a peer that has not proven membership to us that may be refused "
        "(as busy, or ending without a handshake: silent past unproven_handshake_timeout, malformed, closed "
        "early) before it is disconnected, with disconnect_unproven.")
    max_pending_bytes_per_peer: int = Field(
        default=256 * 2**20, ge=2**20, description="Bytes of frames one peer may have us receiving at once "
        "(announced lengths of frames being read); a frame beyond it ends that stream.")
    max_pending_bytes: int = Field(
        default=2**30, ge=2**20, description="The same bound over all peers together.")

    @model_validator(mode="after")
    def _check_totals(self) -> StreamLimits:
        if self.max_streams < self.max_streams_per_peer:
            raise ValueError(f"swarm.streams.max_streams ({self.max_streams}) is below "
                             f"swarm.streams.max_streams_per_peer ({self.max_streams_per_peer}): raise max_streams")
        if self.max_unproven_streams < self.max_unproven_streams_per_peer:
            raise ValueError(f"swarm.streams.max_unproven_streams ({self.max_unproven_streams}) is below "
                             f"swarm.streams.max_unproven_streams_per_peer ({self.max_unproven_streams_per_peer}): "
                             "raise max_unproven_streams")
        return self


class SwarmConfig(Section):
    """How this peer joins the swarm and what it tells others about itself."""

    initial_peers: list[str] = Field(
        default_factory=list,
        description="Multiaddrs of peers to bootstrap from, each ending in /p2p/<peer id>. "
        "Empty: this peer starts a new swarm.",
    )
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
        description="Multiaddrs to listen on. 0.0.0.0 lets peers on other hosts connect (hivemind's own "
        "default, 127.0.0.1, would not); port 0 picks a free port. TCP (/tcp/PORT) or QUIC "
        "(/udp/PORT/quic-v1), or both (docs: networking, 'Choosing a transport').",
    )
    announce_maddrs: list[str] = Field(
        default_factory=list,
        description="Multiaddrs to announce to others instead of the detected ones (e.g. a public IP or a "
        "container DNS name). Ports must be explicit.",
    )
    identity_path: Path | None = Field(
        default=None,
        description="Private key file (from `peerd keygen`) that makes the peer id stable across restarts.",
    )
    secret_path: Path | None = Field(
        default=None,
        description="Swarm secret file (from `peerd keygen --swarm-secret PATH`): only peers holding the same "
        "secret are averaged with, served experts or sent training state, and only their records are read. "
        "Unset (and no allowlist): an open swarm that anyone who knows a peer's address can join.",
    )
    allowlist_path: Path | None = Field(
        default=None,
        description="File of admitted peer ids, one per line (# comments): only these peers are members. "
        "With secret_path too, a member needs both.",
    )
    streams: StreamLimits = Field(default_factory=lambda: StreamLimits(),
                                  description="Per-peer bounds on inbound streams.")
    relay: RelayConfig = Field(default_factory=lambda: RelayConfig(),
                               description="NAT traversal through relays, and relaying for others.")
    roles: list[Role] = Field(default_factory=_default_roles, description="Roles advertised in this peer's record.")
    record_refresh_period: float = Field(
        default=5.0, gt=0, description="Seconds between re-publications of this peer's record."
    )
    record_ttl: float = Field(
        default=20.0, gt=0, description="Seconds a record stays in the DHT after its last refresh."
    )
    nat_port_map: bool = Field(
        default=False,
        description="Let p2pd ask the LAN's router for a port mapping (UPnP/NAT-PMP). Off by default: it sends "
        "discovery traffic to the local network; forward the port or set announce_maddrs instead.",
    )
    bootstrap_attempts: int = Field(default=3, ge=1, le=100, description="Tries to reach the initial peers.")
    bootstrap_retry_delay: float = Field(
        default=2.0, ge=0, description="Seconds before the first retry; doubles on each further try."
    )
    startup_timeout: float = Field(default=30.0, gt=0, description="Seconds for p2pd and the DHT to start.")
    request_timeout: float = Field(default=5.0, gt=0, description="Seconds for one DHT lookup or store.")
    dht_wait_ratio: float | None = Field(
        default=8.0, gt=1,
        description="Times the typical peer's answer time that one DHT request waits for a peer (at least "
        "dht_wait_floor, at most request_timeout). A lookup waits for every node it asks, so a peer that answers "
        "just under request_timeout would make each lookup as slow as it may be; one cut short is skipped by "
        "hivemind for 5 s, doubling while it stays slow. null: every request waits request_timeout.",
    )
    dht_wait_floor: float = Field(
        default=1.0, gt=0,
        description="Seconds a DHT request always may wait, however fast the typical peer answers: room for "
        "a first dial or a busy moment of an honest peer.",
    )
    dht_host: Literal["auto", "daemon", "child"] = Field(
        default="auto",
        description="Where hivemind's DHT node runs. daemon: on the daemon's event loop (one process fewer, and "
        "torch is loaded only for training or experts). child: in hivemind's own child process, whose answers to "
        "other peers never wait on this daemon. auto: on the loop for a light peer (no training, no experts), "
        "else in the child.",
    )
    lookup_beam: int = Field(
        default=10, ge=5, le=64,
        description="Nodes nearest a key that a DHT lookup (every store and read) asks before it settles "
        "(hivemind's beam_size). A key lives on the 5 nodes nearest it; each node asked is a libp2p stream, "
        "and hivemind's default of 20 asks a third of a 64-peer swarm per lookup.",
    )

    @field_validator("initial_peers")
    @classmethod
    def _check_initial_peers(cls, value: list[str]) -> list[str]:
        from peerd.config.addresses import parse_peer_maddr

        return [str(parse_peer_maddr(item, field=f"swarm.initial_peers[{i}]")) for i, item in enumerate(value)]

    @field_validator("host_maddrs")
    @classmethod
    def _check_host_maddrs(cls, value: list[str]) -> list[str]:
        from peerd.config.addresses import parse_listen_maddr

        if not value:
            raise ValueError("at least one listen multiaddr is required")
        return [str(parse_listen_maddr(item, field=f"swarm.host_maddrs[{i}]")) for i, item in enumerate(value)]

    @field_validator("announce_maddrs")
    @classmethod
    def _check_announce_maddrs(cls, value: list[str]) -> list[str]:
        from peerd.config.addresses import parse_announce_maddr

        return [
            str(parse_announce_maddr(item, field=f"swarm.announce_maddrs[{i}]")) for i, item in enumerate(value)
        ]

    @model_validator(mode="after")
    def _check_ttl(self) -> SwarmConfig:
        if self.record_ttl <= self.record_refresh_period:
            raise ValueError(
                f"swarm.record_ttl ({self.record_ttl}) must exceed swarm.record_refresh_period "
                f"({self.record_refresh_period}), or records expire between refreshes: raise swarm.record_ttl"
            )
        return self

    @model_validator(mode="after")
    def _check_relays(self) -> SwarmConfig:
        if self.relay.reachability == "private" and not (self.relay.relays or self.initial_peers):
            raise ValueError("swarm.relay.reachability is private but there is no relay to reserve a slot on: "
                             "set swarm.relay.relays or swarm.initial_peers (a reachable peer)")
        return self

    @property
    def relays(self) -> list[str]:
        """The relays a private peer reserves a slot on: those configured, else the initial peers."""
        return list(self.relay.relays or self.initial_peers)


class ControlConfig(Section):
    """The local control endpoint (HTTP): the status page, /status (what `peerd status` shows) and /metrics."""

    host: str = Field(default="127.0.0.1", description="Address to bind; loopback unless `expose` is set.")
    port: int = Field(
        default=DEFAULT_CONTROL_PORT, ge=0, le=65535, description="TCP port; 0 picks a free one."
    )
    expose: bool = Field(
        default=False, description="Allow binding a non-loopback address (the endpoint has no authentication)."
    )

    @model_validator(mode="after")
    def _check_exposure(self) -> ControlConfig:
        try:
            loopback = ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            loopback = self.host == "localhost"
        if not loopback and not self.expose:
            raise ValueError(
                f"control.host={self.host!r} is not a loopback address; the control endpoint has no "
                "authentication, so set control.expose: true to bind it anyway"
            )
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class LoggingConfig(Section):
    """Log records on stderr."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="Log level.")
    format: Literal["text", "json"] = Field(default="text", description="Log line format on stderr.")
