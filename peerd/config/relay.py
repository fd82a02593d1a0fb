"""How a peer is reached from the internet: NAT traversal through libp2p circuit relays (v2), run by p2pd.

A peer that cannot be dialled (behind a home router or a cloud NAT) reserves a slot on a relay and announces
the relayed address; other peers then reach it through the relay for every protocol, as libp2p does it.
Public peers can relay for others. Everything here configures p2pd's own relay client and service (autorelay,
AutoNAT, the circuit relay v2 resource limits); peerd adds no transport of its own.

p2pd has no access list for its relay service: any libp2p node that reaches a relaying peer can reserve a
slot and open circuits, member of the swarm or not. And p2pd always runs libp2p's default relay service as
well (128 KiB and two minutes per circuit); the configured one (``serve``, :class:`RelayLimits`) replaces it
once AutoNAT finds the peer reachable. peerd's membership handshake still guards every peerd
stream that crosses a circuit, so a stranger gains nothing from the swarm through a relay; what a stranger
can take is the relay's bandwidth, and :class:`RelayLimits` bounds that (docs/networking.md, "Peers behind NAT").
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from peerd.config.base import Section

Reachability = Literal["auto", "public", "private"]


class RelayLimits(Section):
    """What this peer's relay service carries for others; p2pd resets a circuit that exceeds a bound."""

    max_reservations: int = Field(
        default=32, ge=1, le=4096, description="Peers that may hold a relay slot (reservation) here at once.")
    max_circuits: int = Field(
        default=8, ge=1, le=1024, description="Relayed connections open at once to or from any one peer.")
    max_circuit_bytes: int = Field(
        default=2**30, ge=2**16, description="Bytes one relayed connection may carry in each direction before "
        "the relay resets it (a member's next stream opens a new one).")
    max_circuit_seconds: float = Field(
        default=3600.0, ge=10, description="Seconds a relayed connection may stay open before it is reset.")
    buffer_bytes: int = Field(
        default=64 * 2**10, ge=4096, le=16 * 2**20, description="Copy buffer per direction per relayed "
        "connection: the relay's memory is about 2 x buffer_bytes x open circuits.")


class RelayConfig(Section):
    """NAT traversal: whether this peer needs a relay to be reached, which relays, and relaying for others."""

    reachability: Reachability = Field(
        default="auto", description="auto: AutoNAT (other peers try to dial us back) decides whether this "
        "peer is reachable, and a peer found unreachable reserves a slot on a relay; private: it is behind NAT, "
        "reserve a slot at once; public: never use a relay (AutoNAT still decides when relaying for others "
        "starts).")
    relays: list[str] = Field(
        default_factory=list, description="Relays to reserve a slot on when this peer is not reachable, each "
        "ending in /p2p/<peer id>. Empty: the initial peers.")
    serve: bool = Field(
        default=True, description="Relay for others within `limits` (libp2p starts the service once AutoNAT "
        "finds this peer reachable). Off: only p2pd's built-in default relay service runs (libp2p's defaults: "
        "128 KiB and two minutes per circuit), which p2pd offers whenever circuit relay is on.")
    limits: RelayLimits = Field(default_factory=lambda: RelayLimits(), description="Bounds of the relay service.")
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Loopback port where p2pd serves its own metrics, which peerd "
        "reads for relay bytes and circuits; 0 picks a free one.")

    @field_validator("relays")
    @classmethod
    def _check_relays(cls, value: list[str]) -> list[str]:
        from peerd.config.addresses import parse_peer_maddr

        return [str(parse_peer_maddr(item, field=f"swarm.relay.relays[{i}]")) for i, item in enumerate(value)]
