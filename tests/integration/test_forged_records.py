"""A stranger in the DHT of a private swarm writes forged records under the swarm's keys; the peers act as if
it had written nothing (no phantom peer, the victim's record keeps refreshing) and count what they refused.

The forger is a plain hivemind DHT node (no peerd validator) joined to the swarm from the test process. It
writes, under ``<run>.peers``, ``<run>.progress`` and ``<run>.experts``, each expiring after the victim's
record would (10 s ahead: within the 8 + 3 s a reader allows for configs/local.yaml's record_ttl):

- unsigned records in the format peers used before signing (malformed);
- a record about the victim signed by the forger, under the victim's subkey (wrong signer);
- the victim's own signed record with its content changed (its member tag no longer matches: not a member);
- the victim's own signed record re-stored with a later expiration (expiration mismatch), to freeze it;
- its own record, validly signed, without the swarm secret (not a member);
- its own record, expiring in 30 years (expiration too far).

Without verification the phantom peers show up in ``peerd status`` and the later forgeries displace the
victim's record (hivemind keeps the latest expiration), so the test fails when the defence is off.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hivemind.dht import DHT
from hivemind.utils.timed_storage import get_dht_time

from peerd.launcher import LocalSwarm, wait_for
from peerd.swarm.identity import generate_identity
from peerd.swarm.signing import RecordSigner
from peerd.wire.membership import Membership
from tests.helpers import LOCAL_CONFIG
from tests.integration.swarms import private

pytestmark = pytest.mark.integration

RUN = "peerd-local"  # configs/local.yaml
REASONS = ("malformed", "wrong_signer", "expiration_mismatch", "expiration_too_far", "not_member")


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    with private(LOCAL_CONFIG, tmp_path) as local:
        yield local


@pytest.fixture
def forger_dht(swarm: LocalSwarm) -> Iterator[DHT]:
    swarm.start(2, timeout=90)
    # strict=False: hivemind refuses to start a node whose target is late pinging it back (a loaded machine)
    dht = DHT(initial_peers=[swarm.peers[0].ready["maddrs"][0]], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
              strict=False, start=True)
    try:
        yield dht
    finally:
        dht.shutdown()


def phantom_record(peer_id: str, now: float) -> dict[str, Any]:
    return {"peer_id": peer_id, "software_version": "0.1.0", "protocol_version": 1, "roles": ["trainer"],
            "state": "idle", "maddrs": [], "capabilities": {"experts": [], "throughput": None},
            "started_at": now, "updated_at": now}


def forge(dht: DHT, forger: RecordSigner, victim: str, phantom: str) -> None:
    now = get_dht_time()
    later, decades = now + 10.0, now + 30 * 365 * 86400.0
    peers, progress, experts = f"{RUN}.peers", f"{RUN}.progress", f"{RUN}.experts"
    genuine = dht.get(peers, latest=True).value[victim]  # the forger's node checks nothing: it sees the envelope
    envelope, expiration = genuine.value, genuine.expiration_time
    writes: list[tuple[str, str, object, float]] = [
        (peers, phantom, phantom_record(phantom, now), later),
        (progress, phantom, {"peer_id": phantom, "fingerprint": "deadbeef", "step": 10**6, "samples": 10**9,
                             "samples_per_second": 1.0, "time": now}, later),
        (experts, "ffn.0.0", {"uid": "ffn.0.0", "peer_id": phantom, "protocol_version": 2, "hidden_dim": 8,
                              "module": "ffn", "updates": 0, "started_at": now, "updated_at": now}, later),
        (peers, victim, forger.envelope(peers, victim, {**phantom_record(victim, now), "state": "leaving"}, later),
         later),
        (peers, victim, {**envelope, "p": envelope["p"].replace(b'"idle"', b'"leaving"'), "e": expiration + 1e-3},
         expiration + 1e-3),
        (peers, victim, envelope, later),
        (peers, forger.peer_id, forger.envelope(peers, forger.peer_id, phantom_record(forger.peer_id, now), later),
         later),
        (peers, forger.peer_id, forger.envelope(peers, forger.peer_id, phantom_record(forger.peer_id, now), decades),
         decades),
    ]
    for key, subkey, value, until in writes:
        dht.store(key, value, until, subkey=subkey)


@pytest.mark.timeout(300)  # two daemons and a DHT start on a loaded 2-core machine
def test_forged_records_change_nothing_and_are_counted(swarm: LocalSwarm, forger_dht: DHT, tmp_path: Path) -> None:
    first, victim = swarm.peers
    swarm.wait_all_see_each_other(timeout=45)
    generate_identity(tmp_path / "forger.key")
    forger = RecordSigner((tmp_path / "forger.key").read_bytes(), Membership())  # no swarm secret
    phantom = "12D3KooWPGVdJA78uHzBaDhQwqcrKkim73xy95Amd9qCuoKhvDVB"

    forge(forger_dht, forger, victim.peer_id, phantom)
    forged_at = get_dht_time()

    def counted() -> dict[str, int] | None:
        dropped = {peer.name: peer.status()["records_dropped"] for peer in swarm.peers}
        total = {reason: sum(d.get(reason, 0) for d in dropped.values()) for reason in REASONS}
        return total if all(total.values()) else None

    def victim_refreshed() -> dict[str, Any] | None:
        seen = {p["peer_id"]: p for p in first.status()["peers"]}
        entry = seen.get(victim.peer_id)
        return entry if entry is not None and entry["updated_at"] > forged_at + 2.0 else None

    # The victim's record keeps refreshing (record_refresh_period 2 s) although forgeries expiring after it
    # were written under its subkey: none of them displaced it, on any node of ours.
    entry = wait_for(victim_refreshed, 60, "the victim's record to refresh after the forgery")
    assert entry["state"] == "idle" and entry["expires_in"] < 60
    deadline = time.monotonic() + 6.0
    while time.monotonic() < deadline:  # a few more refreshes and status reads, each must be clean
        for peer in swarm.peers:
            listed = {p["peer_id"] for p in peer.status()["peers"]}
            assert listed == {q.peer_id for q in swarm.peers if q is not peer}, (peer.name, listed)
        time.sleep(0.5)  # pacing repeated checks of a steady state, not waiting for an event
    totals = wait_for(counted, 60, "every kind of forgery to be refused and counted")
    assert all(totals[reason] > 0 for reason in REASONS), totals
    assert all(p.proc.poll() is None for p in swarm.peers)
