"""A swarm that stops averaging says so: two real peers that see each other but whose every round fails (here:
min_group_size 3 with 2 trainers) show the stall in status, the status text, /metrics and one WARNING."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from peerd.launcher import LocalSwarm, wait_for
from tests.helpers import REPO, training

pytestmark = pytest.mark.integration

STALLING = ["-o", "averaging.min_group_size=3", "-o", "training.progress_ttl=4"]  # a stall after 8 s


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    with LocalSwarm(REPO / "configs" / "synthetic.yaml", log_dir=tmp_path, extra_args=STALLING) as local_swarm:
        yield local_swarm


@pytest.mark.timeout(120)
def test_rounds_that_all_fail_while_others_train_are_reported_loudly(swarm: LocalSwarm) -> None:
    swarm.start(2)
    peer = swarm.peers[0]
    averaging = wait_for(lambda: (a := training(peer)["averaging"])["stalled"] and a, 60,
                         "the stall to be reported", 0.5)
    assert averaging["others_in_view"] == 1 and "below min_group_size" in averaging["last_error"]
    assert averaging["failed_streak"] >= 3 and averaging["failing_for"] >= 8

    text = subprocess.run([sys.executable, "-m", "peerd", "status", "--control", peer.control],
                          capture_output=True, text=True, timeout=30, check=True).stdout
    assert "WARNING:   averaging has stopped" in text, text
    with urllib.request.urlopen(f"{peer.control}/metrics", timeout=10) as response:
        assert "peerd_averaging_stalled 1.0" in response.read().decode()
    steps = training(peer)["step"]
    wait_for(lambda: training(peer)["step"] >= steps + 5, 30, "5 more (solo) steps", 0.5)
    warnings = [line for line in peer.log_path.read_text().splitlines() if "Averaging has stopped" in line]
    assert len(warnings) == 1 and " WARN" in warnings[0], warnings  # once per streak, not per step
    assert swarm.stop() == [0, 0]
