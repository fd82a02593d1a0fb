"""How this peer is reached and how it reaches the others, as p2pd sees it; and the flags that make it so.

:func:`p2pd_options` turns ``swarm.relay`` into hivemind's ``P2P.create`` arguments plus the p2pd flags hivemind
has no parameter for. :class:`Reachability` then reads, on every refresh, what p2pd did with them: this
peer's own addresses (a ``/p2p-circuit`` address means a relay holds a slot for us), the address of every open
connection (relayed or direct), and the counters p2pd's relay service keeps for the peers it relays for
(its Prometheus endpoint, bound to loopback). Nothing here moves a byte itself.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from hivemind.p2p import P2P
from prometheus_client.parser import text_string_to_metric_families

from peerd.config import SwarmConfig

logger = logging.getLogger(__name__)

CIRCUIT = "/p2p-circuit"
_UNREACHABLE_WARNING_AFTER = 30.0  # seconds a private peer may look for a relay before it says so loudly
# p2pd's metrics grow with the swarm (a series per peer and protocol) and prometheus_client's parser is pure
# Python: parsing all of them on every refresh costs a large swarm's light peers a good share of their CPU. Only
# the relay service's lines count.
_RELAY_LINES = re.compile(r"^(?:# (?:HELP|TYPE) )?libp2p_relaysvc_.*$", re.MULTILINE)


def p2pd_options(config: SwarmConfig, metrics_port: int) -> tuple[dict[str, Any], dict[str, int | str]]:
    """``(P2P.create keyword arguments, extra p2pd flags)`` for ``config.relay``; see ``peerd.config.relay``."""
    relay = config.relay
    kwargs: dict[str, Any] = {}
    flags: dict[str, int | str] = {}
    # A peer is never forced public: p2pd always starts libp2p's default relay service too (128 KiB and two
    # minutes per circuit), and the configured one only wins if it registers later, which it does when AutoNAT
    # finds us reachable some seconds after start; forced public, the two race at start-up.
    kwargs["use_auto_relay"] = relay.reachability != "public"
    if relay.reachability == "private":
        kwargs["force_reachability"] = "private"
    if kwargs["use_auto_relay"] and config.relays:
        # As flags, not hivemind's trusted_relays: hivemind's probe of whether our identity is taken starts
        # a p2pd with autorelay too, and p2pd refuses autorelay without discovery unless relays are given.
        flags["trustedRelays"] = ",".join(config.relays)
        # Static relays: a slot is reserved at once. With discovery on, autorelay waits for four
        # candidates or three minutes, and a small swarm has fewer.
        flags["relayDiscovery"] = 0
    limits = relay.limits
    flags.update({
        "relayService": int(relay.serve),
        "relayMaxReservations": limits.max_reservations,
        "relayMaxCircuits": limits.max_circuits,
        "relayDataLimit": limits.max_circuit_bytes,
        "relayTimeLimit": f"{limits.max_circuit_seconds:g}s",
        "relayBufferSize": limits.buffer_bytes,
        "metricsAddr": f"127.0.0.1:{metrics_port}",
    })
    return kwargs, flags


def free_loopback_port() -> int:
    """A TCP port free on loopback now, for p2pd's metrics endpoint (which cannot report the one it picks)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def relay_of(address: str) -> str | None:
    """The relay's peer id in a ``.../p2p/<relay>/p2p-circuit...`` address, else None (a direct address)."""
    head, found, _ = address.partition(CIRCUIT)
    if not found:
        return None
    return head.rsplit("/p2p/", 1)[-1] if "/p2p/" in head else "unknown"


@dataclass
class RelayService:
    """Counters of this peer's relay service for others, from p2pd's metrics (None: not read yet)."""

    active: bool | None = None
    reservations_open: int | None = None
    circuits_open: int | None = None
    circuits_total: int | None = None
    bytes_relayed: int | None = None
    refused: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> RelayService:
        values: dict[tuple[str, str], float] = {}
        refused: dict[str, int] = {}
        for family in text_string_to_metric_families("\n".join(_RELAY_LINES.findall(text)) + "\n"):
            for sample in family.samples:
                label = sample.labels.get("type") or sample.labels.get("status") or ""
                if sample.name.endswith("_response_status_total") and label != "ok":
                    kind = "circuit" if "connection" in sample.name else "reservation"
                    refused[f"{kind}_{label}"] = refused.get(f"{kind}_{label}", 0) + int(sample.value)
                values[(sample.name, label)] = sample.value
        if not values:
            return cls()

        def count(name: str, label: str = "") -> int:
            return int(values.get((f"libp2p_relaysvc_{name}", label), 0))

        opened = count("connections_total", "opened")
        return cls(
            active=bool(values.get(("libp2p_relaysvc_status", ""), 0)),
            reservations_open=count("reservations_total", "opened") - count("reservations_total", "closed"),
            circuits_open=opened - count("connections_total", "closed"),
            circuits_total=opened,
            bytes_relayed=count("data_transferred_bytes_total"),
            refused=refused,
        )


class Reachability:
    """The last view of how we are reached (own addresses) and how we reach each connected peer."""

    def __init__(self, config: SwarmConfig, metrics_port: int) -> None:
        self.config = config
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.addresses: list[str] = []
        self.connections: dict[str, str] = {}  # peer id -> address of the connection we have to it
        self.service = RelayService()
        self._state = "starting"
        self._since = time.monotonic()
        self._warned = False
        self._metrics_error: str | None = None

    @property
    def relays(self) -> list[str]:
        """Relays that hold a slot for us (from our own relayed addresses)."""
        return sorted({relay for a in self.addresses if (relay := relay_of(a)) is not None})

    @property
    def state(self) -> str:
        if self.relays:
            return "relayed"
        if self.config.relay.reachability == "private":
            return "unreachable"  # behind NAT and no relay slot (yet): nobody can open a stream to us
        return "public" if self.config.relay.reachability == "public" else "direct"

    async def refresh(self, p2p: P2P, timeout: float) -> None:
        self.addresses = [str(a) for a in await p2p.get_visible_maddrs(latest=True)]
        self.connections = {str(info.peer_id): str(info.addrs[0]) if info.addrs else ""
                            for info in await p2p.list_peers()}
        try:
            # identity: on loopback, gzip would only cost p2pd and us CPU on every refresh
            async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
                        session.get(self.metrics_url, headers={"Accept-Encoding": "identity"}) as response):
                self.service = RelayService.parse(await response.text())
            self._metrics_error = None
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            if self._metrics_error is None:  # once per streak: status polls would repeat it every few seconds
                logger.warning("Could not read p2pd's metrics at %s (%r): relay counters stay unknown",
                               self.metrics_url, e)
            self._metrics_error = repr(e)
        self._log_changes()

    def _log_changes(self) -> None:
        state = self.state
        if state != self._state:
            self._state, self._since, self._warned = state, time.monotonic(), False
            if state == "relayed":
                logger.info("Reachable through relay %s", ", ".join(self.relays))
            elif state == "unreachable":
                logger.warning("No relay holds a slot for this peer any more: other peers cannot reach it "
                               "(relays: %s)", ", ".join(self.config.relays))
        if state == "unreachable" and not self._warned and time.monotonic() - self._since > _UNREACHABLE_WARNING_AFTER:
            self._warned = True
            logger.warning("swarm.relay.reachability is private and no relay has given this peer a slot after "
                           "%.0fs: other peers cannot open streams to it. Relays tried: %s (each must be reachable "
                           "and have swarm.relay.serve on)", _UNREACHABLE_WARNING_AFTER, ", ".join(self.config.relays))

    def via(self, peer_id: str) -> str:
        """How we reach ``peer_id`` now: ``direct``, ``relay <id>``, or ``not connected``."""
        address = self.connections.get(peer_id)
        if address is None:
            return "not connected"
        relay = relay_of(address)
        return "direct" if relay is None else f"relay {relay}"

    def status(self) -> dict[str, Any]:
        relayed = sum(1 for a in self.connections.values() if relay_of(a) is not None)
        limits = self.config.relay.limits
        return {
            "configured": self.config.relay.reachability,
            "state": self.state,
            "relays": self.relays,
            "addresses": self.addresses,
            "connections": {"direct": len(self.connections) - relayed, "relayed": relayed},
            "relay_service": {
                "enabled": self.config.relay.serve,
                "active": self.service.active,
                "reservations_open": self.service.reservations_open,
                "circuits_open": self.service.circuits_open,
                "circuits_total": self.service.circuits_total,
                "bytes_relayed": self.service.bytes_relayed,
                "refused": self.service.refused,
                "limits": limits.model_dump(),
            },
        }
