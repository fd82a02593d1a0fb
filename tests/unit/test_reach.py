"""NAT traversal settings: what p2pd is told, how its answers are read, how status shows them."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from peerd.config import SwarmConfig
from peerd.metrics import DaemonMetrics
from peerd.swarm.reach import Reachability, RelayService, p2pd_options, relay_of
from peerd.tables import format_reachability

RELAY = "12D3KooWMP2QCXxpWfzhvrjSnHfQUfcNKsRdMhxG8DbSC18PsYu8"
ME = "12D3KooWK31R7XuXoYSWZw71z4YeHgJeTPBXpRnKzzvxX93Q55rr"
BOOTSTRAP = f"/ip4/7.79.0.2/tcp/4001/p2p/{RELAY}"

# lines of p2pd's own /metrics, as served by a relay that carried one circuit
P2PD_METRICS = """
# HELP libp2p_relaysvc_connections_total Relay Connection Total
# TYPE libp2p_relaysvc_connections_total counter
libp2p_relaysvc_connections_total{type="opened"} 3
libp2p_relaysvc_connections_total{type="closed"} 2
# TYPE libp2p_relaysvc_connection_request_response_status_total counter
libp2p_relaysvc_connection_request_response_status_total{status="ok"} 3
libp2p_relaysvc_connection_request_response_status_total{status="resource limit exceeded"} 4
# TYPE libp2p_relaysvc_data_transferred_bytes_total counter
libp2p_relaysvc_data_transferred_bytes_total 2.02868e+06
# TYPE libp2p_relaysvc_reservations_total counter
libp2p_relaysvc_reservations_total{type="opened"} 2
# TYPE libp2p_relaysvc_status gauge
libp2p_relaysvc_status 1
# TYPE libp2p_rcmgr_memory gauge
libp2p_rcmgr_memory{protocol="/libp2p/circuit/relay/0.2.0/hop",scope="protocol"} 0
"""


def test_p2pd_is_told_to_reserve_on_the_bootstrap_peers_at_once_when_private() -> None:
    config = SwarmConfig(initial_peers=[BOOTSTRAP], relay={"reachability": "private"})
    kwargs, flags = p2pd_options(config, 9100)
    assert kwargs == {"use_auto_relay": True, "force_reachability": "private"}
    assert flags["trustedRelays"] == BOOTSTRAP and flags["relayDiscovery"] == 0  # static: no 3-minute wait
    assert flags["metricsAddr"] == "127.0.0.1:9100"


def test_relay_limits_reach_p2pd_and_a_public_peer_never_uses_a_relay() -> None:
    config = SwarmConfig(relay={"reachability": "public", "serve": True,
                                "limits": {"max_circuit_bytes": 2**20, "max_circuit_seconds": 90,
                                           "max_reservations": 3, "max_circuits": 2, "buffer_bytes": 8192}})
    kwargs, flags = p2pd_options(config, 9100)
    assert kwargs == {"use_auto_relay": False}  # never forced public: see p2pd_options
    assert "trustedRelays" not in flags
    assert (flags["relayService"], flags["relayDataLimit"], flags["relayTimeLimit"], flags["relayMaxReservations"],
            flags["relayMaxCircuits"], flags["relayBufferSize"]) == (1, 2**20, "90s", 3, 2, 8192)
    assert p2pd_options(SwarmConfig(relay={"serve": False}), 1)[1]["relayService"] == 0


def test_a_private_peer_without_any_relay_is_refused_naming_the_options() -> None:
    with pytest.raises(ValidationError, match=r"swarm\.relay\.reachability is private.*swarm\.relay\.relays"):
        SwarmConfig(relay={"reachability": "private"})
    with pytest.raises(ValidationError, match=r"swarm\.relay\.relays\[0\]"):
        SwarmConfig(relay={"relays": ["/ip4/1.2.3.4/tcp/1"]})  # no /p2p/<id>: p2pd could not use it
    assert SwarmConfig(initial_peers=[BOOTSTRAP], relay={"relays": []}).relays == [BOOTSTRAP]


def test_p2pd_metrics_are_read_into_relay_counters() -> None:
    service = RelayService.parse(P2PD_METRICS)
    assert service.active is True
    assert (service.circuits_total, service.circuits_open, service.reservations_open) == (3, 1, 2)
    assert service.bytes_relayed == 2028680
    assert service.refused == {"circuit_resource limit exceeded": 4}
    assert RelayService.parse("# nothing relayed here\n") == RelayService()


def test_relayed_addresses_and_connections_are_told_apart() -> None:
    assert relay_of(f"{BOOTSTRAP}/p2p-circuit/p2p/{ME}") == RELAY
    assert relay_of(f"{BOOTSTRAP}/p2p-circuit") == RELAY
    assert relay_of("/ip4/7.79.0.3/tcp/5000") is None
    reach = Reachability(SwarmConfig(initial_peers=[BOOTSTRAP], relay={"reachability": "private"}), 9100)
    assert reach.state == "unreachable"
    reach.addresses = [f"/ip4/192.168.11.2/tcp/5/p2p/{ME}", f"{BOOTSTRAP}/p2p-circuit/p2p/{ME}"]
    reach.connections = {RELAY: "/ip4/7.79.0.2/tcp/4001", "peerB": f"{BOOTSTRAP}/p2p-circuit"}
    assert (reach.state, reach.relays) == ("relayed", [RELAY])
    assert (reach.via(RELAY), reach.via("peerB"), reach.via("peerC")) == ("direct", f"relay {RELAY}", "not connected")
    status = reach.status()
    assert status["connections"] == {"direct": 1, "relayed": 1}
    text = "\n".join(format_reachability(status))
    assert "through relay 12D3Ko...8PsYu8" in text and "1 relayed" in text


def test_reachability_and_relay_counters_are_exported_as_metrics() -> None:
    reach = Reachability(SwarmConfig(relay={"reachability": "public"}), 9100)
    reach.service = RelayService.parse(P2PD_METRICS)
    text = DaemonMetrics().render({"peer_id": ME, "reachability": reach.status()}).decode()
    assert 'peerd_reachability{state="public"} 1.0' in text
    assert "peerd_relay_bytes_total 2.02868e+06" in text
    assert "peerd_relay_reservations 2.0" in text and "peerd_relay_circuits_open 1.0" in text
