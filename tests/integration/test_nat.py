"""Peers behind NAT train together and call each other's experts through a relay (real NAT, real p2pd).

The NAT lab (``natlab.py``) puts a relay and a public peer on a shared "internet" and two peers each behind its
own masquerading router: neither natted peer can open a connection to the other, nor can anyone else open
one to them. They reserve a slot on the relay (``swarm.relay.reachability: private``, the relay is their
bootstrap peer), and every stream between them (DHT, averaging, expert calls) crosses the relay.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from peerd.launcher import PeerProcess, wait_for
from tests.helpers import MOE_CONFIG, experts_option, training
from tests.integration.natlab import NatLab, NetnsPeer, nat_lab_or_skip, public_maddr

pytestmark = pytest.mark.integration


def nat_config(secret: Path) -> str:
    """The MoE LM swarm (MOE_CONFIG), open to other hosts, private, with timeouts for calls through a relay."""
    config = yaml.safe_load(MOE_CONFIG)
    config["run_name"] = "peerd-nat-test"
    config["swarm"].update(host_maddrs=["/ip4/0.0.0.0/tcp/0"], record_ttl=6.0, secret_path=str(secret))
    config["training"]["task"]["options"]["moe"]["timeout"] = 4.0
    config["training"]["target_batch_size"] = 24
    config["averaging"] = {"min_group_size": 2}
    return str(yaml.safe_dump(config))


EXPERTS = experts_option(4, record_ttl=8.0)


@pytest.fixture
def lab() -> Iterator[NatLab]:
    with nat_lab_or_skip(public=["relay", "pub"], natted=["a", "b"]) as built:
        yield built


@pytest.fixture
def config(tmp_path: Path) -> Path:
    secret = tmp_path / "swarm.secret"
    subprocess.run([sys.executable, "-m", "peerd", "keygen", "--swarm-secret", str(secret)], check=True,
                   capture_output=True, timeout=60)
    path = tmp_path / "nat.yaml"
    path.write_text(nat_config(secret))
    return path


def reach(peer: PeerProcess) -> dict[str, Any]:
    return peer.status()["reachability"]


def connection_to(peer: PeerProcess, other: PeerProcess) -> str | None:
    for entry in peer.status()["peers"]:
        if entry["peer_id"] == other.peer_id:
            return str(entry["connection"])
    return None


def remote_calls(peer: PeerProcess) -> tuple[int, int]:
    """(forward calls answered, calls failed) of ``peer``'s model to experts it does not host."""
    client = (peer.status()["experts"] or {}).get("client") or {}
    answered = failed = 0
    for info in client.get("experts", {}).values():
        forward, backward = info.get("forward", {}), info.get("backward", {})
        answered += int(forward.get("calls", 0)) - int(forward.get("errors", 0))
        failed += int(forward.get("errors", 0)) + int(backward.get("errors", 0))
    return answered, failed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("natted_reachability", ["private", "auto"])
def test_natted_peers_average_and_call_experts_through_the_relay(lab: NatLab, config: Path, tmp_path: Path,
                                                                 natted_reachability: str) -> None:
    """``private``: the natted peers say so; ``auto`` (the default): AutoNAT finds them unreachable."""
    common = ["--config", str(config)]
    peers: list[NetnsPeer] = []

    def start(name: str, *args: str) -> NetnsPeer:
        peer = NetnsPeer(name, lab.ns(name), [*common, *args], tmp_path)
        peers.append(peer)
        return peer

    try:
        relay = start("relay", "-o", "training.enabled=false", "-o", "swarm.roles=[bootstrap]")
        relay.wait_ready(60)
        bootstrap = ["--initial-peers", public_maddr(relay, lab.addr("relay"))]
        pub = start("pub", *bootstrap)
        # The relay's own service starts once AutoNAT (pub dialling it back) finds it reachable. Slots reserved
        # before that are on p2pd's default service, which it replaces (docs/networking.md, "Peers behind NAT").
        wait_for(lambda: reach(relay)["relay_service"]["active"], 90, "the relay's relay service to start", 0.5)
        natted = ["-o", f"swarm.relay.reachability={natted_reachability}"]
        b = start("b", *bootstrap, *natted, "-o", f"experts={EXPERTS}")
        a = start("a", *bootstrap, *natted)
        for peer in (a, b, pub):
            peer.wait_ready(90)

        # each natted peer holds a slot on the relay and announces its relayed address
        ready_at = time.monotonic()
        for peer in (a, b):
            wait_for(lambda p=peer: reach(p)["relays"] == [relay.peer_id], 90, f"{peer.name} to reserve a slot", 0.5)
            assert reach(peer)["state"] == "relayed"
            assert any("/p2p-circuit" in m for m in reach(peer)["addresses"])
        slots_after = time.monotonic() - ready_at
        calls_before = remote_calls(a)  # calls made before b had its slot could not reach b

        # they average in groups with each other and the public peer, and a calls b's experts
        wait_for(lambda: all(training(p)["rounds_ok"] >= 3 for p in (a, b, pub)), 150,
                 "3 averaging rounds on each trainer", 0.5)
        wait_for(lambda: remote_calls(a)[0] >= 10, 60, "10 expert calls from a to b's experts", 0.5)

        # every connection between the natted peers crosses the relay; the relay counts what it carried
        assert connection_to(a, b) == f"relay {relay.peer_id}", a.status()["peers"]
        assert connection_to(b, a) == f"relay {relay.peer_id}", b.status()["peers"]
        service = reach(relay)["relay_service"]
        assert service["active"] is True and service["bytes_relayed"] > 0 and service["circuits_total"] >= 1, service
        report_a, report_b = training(a), training(b)
        sizes = {**report_a["group_sizes"]}
        assert int(sizes.get("3", 0)) + int(sizes.get("2", 0)) >= 3, report_a
        answered, failed = (now - before for now, before in zip(remote_calls(a), calls_before, strict=True))
        print(f"\n[nat {natted_reachability}] both natted peers relayed {slots_after:.1f}s after their ready lines; a: rounds_ok={report_a['rounds_ok']} rounds_solo={report_a['rounds_solo']} "
              f"group_sizes={report_a['group_sizes']}; b: rounds_ok={report_b['rounds_ok']} "
              f"group_sizes={report_b['group_sizes']}; a's expert calls to b since then answered={answered} failed={failed}; "
              f"relay: {service['bytes_relayed']} bytes in {service['circuits_total']} circuits, "
              f"{service['reservations_open']} reservations")
        assert failed <= answered // 5, (answered, failed)
        for peer in reversed(peers):
            assert peer.stop() == 0, peer.log_tail()
    finally:
        for peer in peers:
            peer.kill()
