"""A peer in another DHT than its initial peer notices, says so and heals, without restarting.

A and B each start a DHT of their own (same run name). W's config names A as its initial peer but its DHT joins
through B (tests/integration/splitpeer.py): W sees B's record, not A's, although A answers. Its view checks
(peerd.swarm.view, every 10 s) confirm the partial view, W logs one WARNING, status shows ``view.partial``,
and its re-bootstrap dials A: the two DHTs become one, every peer lists the other two, and W logs that its view
is whole again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from peerd.launcher import PeerProcess, wait_for
from tests.helpers import LOCAL_CONFIG, REPO

pytestmark = pytest.mark.integration


@pytest.fixture
def peers() -> Iterator[list[PeerProcess]]:
    started: list[PeerProcess] = []
    try:
        yield started
    finally:
        for peer in started:
            peer.kill()


def start(peers: list[PeerProcess], name: str, log_dir: Path, *args: str, module: str = "peerd",
          env: dict[str, str] | None = None) -> PeerProcess:
    peer = PeerProcess(name, ["--config", str(LOCAL_CONFIG), "--control-port", "0", *args], log_dir, env=env,
                       module=module)
    peers.append(peer)
    peer.wait_ready(60)
    return peer


@pytest.mark.timeout(180)
def test_a_peer_in_another_dht_than_its_initial_peer_warns_and_heals(peers: list[PeerProcess],
                                                                       tmp_path: Path) -> None:
    a = start(peers, "a", tmp_path)
    b = start(peers, "b", tmp_path)
    w = start(peers, "w", tmp_path, "--initial-peers", a.ready["maddrs"][0], module="tests.integration.splitpeer",
              env={"SPLIT_BOOTSTRAP": b.ready["maddrs"][0], "PYTHONPATH": str(REPO)})
    everyone = {a.peer_id, b.peer_id, w.peer_id}

    def flagged() -> dict[str, object] | None:
        view = w.status()["view"]
        return view if view["partial"] else None

    view = wait_for(flagged, 60, "w to flag its partial view")
    assert "initial peer" in str(view["reason"]) and view["rebootstraps"] == 1

    def whole() -> bool:
        return all(p.seen_peer_ids() | {p.peer_id} == everyone for p in (a, b, w))

    wait_for(whole, 60, "the two DHTs to become one")
    wait_for(lambda: "whole again" in w.log_path.read_text(), 30, "w to log that its view is whole again")
    log = w.log_path.read_text()
    assert log.count("Partial view of the swarm (split brain?)") == 1, log
    assert not a.status()["view"]["partial"] and not b.status()["view"]["partial"]
