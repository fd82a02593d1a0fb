"""A stranger cannot take more from a peerd relay than ``swarm.relay.limits`` allows (real NAT, real p2pd).

p2pd's relay service has no access list, so a libp2p node outside a private swarm can reserve a slot on a
public peerd peer and open circuits through it (docs/networking.md, "Peers behind NAT"). What it can take is bounded:
here two strangers behind their own NATs push data to each other through a peerd relay of a private swarm.
With the bound set as p2pd ships it (4 GiB per circuit) all of it passes; with ``max_circuit_bytes`` set,
the relay resets the circuit at the bound and counts what it carried in ``peerd status``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from peerd.launcher import PeerProcess, wait_for
from tests.integration.natlab import NatLab, NetnsPeer, nat_lab_or_skip, public_maddr

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
PUSHED = 8 * 2**20
BOUND = 2**20
P2PD_DEFAULT = 2**32  # p2pd's own -relayDataLimit
SCRIPT = str(HERE / "relay_stranger.py")


@pytest.fixture
def lab() -> Iterator[NatLab]:
    with nat_lab_or_skip(public=["relay", "pub"], natted=["s1", "s2"]) as built:
        yield built


SINKS, SLOT_WAIT = 3, 30.0


def start_sink(lab: NatLab, relay_maddr: str, report: Path, log_path: Path) -> subprocess.Popen[bytes]:
    report.unlink(missing_ok=True)
    with open(log_path, "wb") as log:
        return subprocess.Popen(lab.exec_prefix("s1") + [sys.executable, SCRIPT, "sink", relay_maddr, str(report)],
                                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)


def stop_sink(sink: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sink.pid, signal.SIGKILL)  # its group: the sink and the p2pd it started
    sink.wait(10)


def strangers_push(lab: NatLab, relay: PeerProcess, tmp_path: Path, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The sink's last report and the source's result after the source pushed PUSHED bytes via the relay.

    libp2p's autorelay tries a relay once and, if that fails, leaves it alone for an hour: a sink whose first
    reservation fails (say the relay's AutoNAT changed its mind for a moment) never gets a slot. Like a real
    stranger, the test then starts a new node, at most SINKS in all, and prints why each one gave up.
    """
    relay_maddr = public_maddr(relay, lab.addr("relay"))
    report = tmp_path / f"sink-{name}.json"

    def relayed() -> dict[str, Any] | None:
        data: dict[str, Any] | None = json.loads(report.read_text()) if report.exists() else None
        return data if data and data["relayed"] else None

    for attempt in range(1, SINKS + 1):
        sink_log = tmp_path / f"sink-{name}-{attempt}.log"
        sink = start_sink(lab, relay_maddr, report, sink_log)
        try:
            sink_id = wait_for(relayed, SLOT_WAIT, "the stranger to get a slot on the peerd relay")["peer_id"]
            break
        except TimeoutError:
            failure = (f"sink {attempt} got no slot in {SLOT_WAIT:.0f}s: exit code {sink.poll()}, last report "
                       f"{report.read_text() if report.exists() else None}, log {sink_log.read_text()[-2000:]!r}, "
                       f"relay reachability {relay.status()['reachability']}")
            print(f"\n[relay limits] {failure}")
            stop_sink(sink)
            if attempt == SINKS:
                raise AssertionError(f"{failure}\n{relay.log_tail()}") from None
    try:
        pushed = subprocess.run(lab.exec_prefix("s2") + [sys.executable, SCRIPT, "source", relay_maddr, sink_id,
                                                         str(PUSHED), str(report)], check=False, capture_output=True,
                                text=True, timeout=120)
        assert pushed.stdout.strip(), pushed.stderr[-2000:]
        result = json.loads(pushed.stdout.strip().splitlines()[-1])
        previous = -1

        def settled() -> dict[str, Any] | None:  # the sink stops counting once the stream is over
            nonlocal previous
            data = json.loads(report.read_text())
            done = data["received"] == previous
            previous = data["received"]
            return data if done else None

        return wait_for(settled, 30, "the sink's count to settle", 1.0), result
    finally:
        stop_sink(sink)


def circuits_counted(relay: PeerProcess) -> dict[str, Any] | None:
    """The relay's ``relay_service`` status once it counts the circuit (it refreshes every few seconds)."""
    service: dict[str, Any] = relay.status()["reachability"]["relay_service"]
    return service if (service["circuits_total"] or 0) >= 1 else None


@pytest.mark.timeout(300)
def test_a_stranger_gets_no_more_than_the_relay_limits(lab: NatLab, tmp_path: Path) -> None:
    secret = tmp_path / "swarm.secret"
    subprocess.run([sys.executable, "-m", "peerd", "keygen", "--swarm-secret", str(secret)], check=True,
                   capture_output=True, timeout=60)
    member = ["--config", str(HERE.parents[1] / "configs" / "local.yaml"), "--host-maddrs", "/ip4/0.0.0.0/tcp/0",
              "-o", "control.port=0", "-o", "training.enabled=false", "-o", f"swarm.secret_path={secret}"]
    # a second public member: AutoNAT needs another peer to dial the relay back before its relay service starts
    pub = NetnsPeer("pub", lab.ns("pub"), member, tmp_path)
    received = {}
    try:
        pub.wait_ready(60)
        for label, bound in (("defence off", P2PD_DEFAULT), ("defence on", BOUND)):
            received[label] = relay_for_strangers(lab, pub, member, label, bound, tmp_path)
        assert pub.stop() == 0, pub.log_tail()
    finally:
        pub.kill()
    assert received["defence off"] == PUSHED  # without the bound, everything the stranger sent got through
    assert received["defence on"] <= BOUND, received  # with it, the relay cut the circuit at the bound


def relay_for_strangers(lab: NatLab, pub: PeerProcess, member: list[str], label: str, bound: int,
                        tmp_path: Path) -> int:
    """Bytes that reached the sink through a new peerd relay with ``max_circuit_bytes=bound``."""
    relay = NetnsPeer(f"relay-{bound}", lab.ns("relay"), [
        *member, "--initial-peers", public_maddr(pub, lab.addr("pub")),
        "-o", f"swarm.relay.limits.max_circuit_bytes={bound}"], tmp_path)
    try:
        relay.wait_ready(60)
        wait_for(lambda: relay.status()["reachability"]["relay_service"]["active"], 90,
                 "AutoNAT to find the relay reachable and its relay service to start", 0.5)
        sink, source = strangers_push(lab, relay, tmp_path, str(bound))
        try:
            service = wait_for(lambda r=relay: circuits_counted(r), 30, "the relay's status to count the circuit")
        except TimeoutError:
            raise AssertionError((sink, source, relay.status()["reachability"], relay.log_tail())) from None
        print(f"\n[relay limits] {label}: max_circuit_bytes={bound}; the stranger pushed {source['sent']} "
              f"bytes, {sink['received']} arrived (source error: {source['error']}); relay status: "
              f"{service['bytes_relayed']} bytes relayed, {service['circuits_total']} circuits")
        assert service["bytes_relayed"] > 0, service
        assert relay.stop() == 0, relay.log_tail()
        return int(sink["received"])
    finally:
        relay.kill()
