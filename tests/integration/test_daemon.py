"""Real processes: `peerd start` subprocesses with their own p2pd, on loopback, bootstrapped from peer 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from peerd.launcher import LocalSwarm, PeerProcess, alive_pids, describe_process, wait_for
from tests.helpers import LOCAL_CONFIG, REPO

pytestmark = pytest.mark.integration


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    with LocalSwarm(LOCAL_CONFIG, log_dir=tmp_path) as local_swarm:
        yield local_swarm


def peerd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "peerd", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.timeout(150)
def test_three_peers_see_each_other_and_a_stopped_peer_disappears(swarm: LocalSwarm) -> None:
    swarm.start(3)
    first, second, third = swarm.peers
    assert all(p.ready["maddrs"] and p.ready["control"].startswith("http://127.0.0.1:") for p in swarm.peers)
    swarm.wait_all_see_each_other(timeout=45)

    # The CLI, as a user runs it, against each daemon's own control endpoint.
    for peer in swarm.peers:
        result = peerd("status", "--control", peer.control, "--json", timeout=30)
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["peer_id"] == peer.peer_id
        assert {p["peer_id"] for p in data["peers"]} == {q.peer_id for q in swarm.peers if q is not peer}
        assert all(p["state"] == "idle" and p["maddrs"] for p in data["peers"])
        assert data["uptime"] > 0 and data["maddrs"]
    # Split-brain detection (peerd.swarm.view) counts the same three, and each record says so to the others.
    def views_whole() -> bool:
        statuses = [p.status() for p in swarm.peers]
        return all(s["view"]["seen"] == 3 and not s["view"]["partial"] and s["view"]["read_seconds"]["p50"]
                   and all(r.get("peers_seen") == 3 for r in s["peers"]) for s in statuses)

    wait_for(views_whole, 40, "every view check and record to count 3 peers")
    # Light peers, having served status, read records and checked views, never loaded torch (peerd.footprint)
    assert all("libtorch" not in Path(f"/proc/{p.proc.pid}/maps").read_text() for p in swarm.peers)
    human = peerd("status", "--control", first.control, timeout=30)
    assert human.returncode == 0 and second.peer_id[-6:] in human.stdout and "peers seen (2)" in human.stdout

    # SIGTERM the third: it announces leaving, exits 0 with its whole process tree gone ...
    tree = set(third.alive_tree())
    assert len(tree) >= 2, "expected the daemon and p2pd"
    assert third.stop(signal.SIGTERM, timeout=12) == 0
    assert third.orphans == [], "child processes outlived the daemon"
    assert "Announced leaving" in third.log_path.read_text()

    # ... and the others drop it once its record expires (record_ttl in configs/local.yaml is 8 s).
    for peer in (first, second):
        wait_for(lambda p=peer: third.peer_id not in p.seen_peer_ids(), 30, f"{peer.name} to forget peer2")
        assert second.peer_id in first.seen_peer_ids() or peer is second

    codes = [peer.stop(signal.SIGTERM, timeout=12) for peer in (second, first)]
    assert codes == [0, 0]
    assert first.orphans == [] and second.orphans == []


# A light peer runs its DHT on the daemon's loop and p2pd as the daemon's child; a trainer runs both in
# hivemind's DHT child process. Either tree must outlive a Ctrl-C long enough to leave, and die with a SIGKILL.
TREES = [pytest.param((), 2, id="light: daemon, p2pd"),
         pytest.param(("-o", "training.enabled=true"), 3, id="trainer: daemon, DHT child, p2pd")]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("args", "processes"), TREES)
def test_ctrl_c_to_the_process_group_shuts_down_cleanly(swarm: LocalSwarm, args: tuple[str, ...],
                                                        processes: int) -> None:
    """A terminal's Ctrl-C reaches the whole foreground group; the DHT must survive to announce leaving."""
    peer = swarm.add_peer(args)
    tree = peer.alive_tree()
    assert len(tree) == processes, [describe_process(pid) for pid in tree]
    os.killpg(peer.proc.pid, signal.SIGINT)
    assert peer.proc.wait(12) == 0
    assert "Announced leaving" in peer.log_path.read_text()
    wait_for(lambda: not peer.alive_tree(), 5, "the process tree to exit")
    assert set(tree) >= {peer.proc.pid}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "processes"), TREES)
def test_sigkilled_daemon_leaves_no_p2pd_behind(swarm: LocalSwarm, args: tuple[str, ...], processes: int) -> None:
    peer = swarm.add_peer(args)
    tree = peer.alive_tree()
    assert len(tree) == processes, [describe_process(pid) for pid in tree]
    peer.proc.kill()
    peer.proc.wait(10)
    wait_for(lambda: not peer.alive_tree(), 10, "p2pd (and the DHT child) to follow the killed daemon")


LAUNCHER_SCRIPT = """
import sys, time
from pathlib import Path
from peerd.launcher import LocalSwarm
with LocalSwarm(Path(sys.argv[1]), log_dir=Path(sys.argv[2])) as swarm:
    print(" ".join(map(str, swarm.add_peer().alive_tree())), flush=True)
    time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_sigterm_to_a_launcher_stops_the_peers_it_started(tmp_path: Path) -> None:
    """`kill <pid>` of a script holding a LocalSwarm (a benchmark, `peerd swarm`) must not orphan its peers."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER_SCRIPT, str(LOCAL_CONFIG), str(tmp_path)],
                                stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert launcher.stdout is not None
        pids = [int(pid) for pid in launcher.stdout.readline().split()]
        assert len(pids) >= 2, pids  # the daemon and its p2pd (a light peer runs its DHT on the daemon's loop)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 128 + signal.SIGTERM
        wait_for(lambda: not alive_pids(pids), 20, "the launcher's peer processes to stop")
    finally:
        launcher.kill()
        launcher.wait(10)
        if launcher.stdout is not None:
            launcher.stdout.close()
        for pid in alive_pids(pids):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_bad_initial_peers_value_exits_with_a_readable_message() -> None:
    result = peerd("start", "--config", str(LOCAL_CONFIG), "--initial-peers", "/ip4/127.0.0.1/tcp/4001")
    assert result.returncode == 1
    assert "swarm.initial_peers[0]" in result.stderr and "/p2p/" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.timeout(60)
def test_unwritable_checkpoint_directory_is_refused_at_start_naming_it(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    blocked = tmp_path / "a-file" / "checkpoints"  # root writes through any mode; nothing creates this path
    result = peerd("start", "--config", str(REPO / "configs" / "synthetic.yaml"),
                   "-o", f"training.checkpoint.directory={blocked}")
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()  # before p2pd, the DHT or a step: nothing else to report
    assert f"training.checkpoint.directory {blocked} is not writable: Not a directory (ENOTDIR)" in line
    assert result.stdout == ""


@pytest.mark.timeout(90)
def test_unreachable_bootstrap_exits_after_bounded_retries(tmp_path: Path) -> None:
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWPGVdJA78uHzBaDhQwqcrKkim73xy95Amd9qCuoKhvDVB"
    peer = PeerProcess(
        "lonely",
        ["--config", str(LOCAL_CONFIG), "--initial-peers", dead, "-o", "swarm.bootstrap_retry_delay=0.2"],
        tmp_path,
    )
    try:
        code = peer.proc.wait(60)
    finally:
        peer.kill()
    log = peer.log_path.read_text()
    assert code == 1
    assert "could not reach any initial peer after 3 attempts" in log and dead in log
    assert "Traceback" not in log


@pytest.mark.timeout(120)
def test_identity_keeps_the_peer_id_across_restarts(tmp_path: Path) -> None:
    key = tmp_path / "peer.key"
    result = peerd("keygen", str(key))
    assert result.returncode == 0, result.stderr
    expected = result.stdout.strip()
    assert peerd("keygen", str(key)).returncode == 1  # never overwrites silently

    for attempt in range(2):
        peer = PeerProcess(f"id{attempt}", ["--config", str(LOCAL_CONFIG), "--identity", str(key)], tmp_path)
        try:
            assert peer.wait_ready(60)["peer_id"] == expected
            assert peer.stop() == 0
        finally:
            peer.kill()


@pytest.mark.timeout(30)
def test_status_without_a_daemon_is_a_clear_error() -> None:
    result = peerd("status", "--control", "127.0.0.1:9", "--timeout", "2")
    assert result.returncode == 1
    assert "no peerd daemon answered at http://127.0.0.1:9/status" in result.stderr
