"""A stranger eclipses a private swarm's keys in the DHT, with real processes: ten hivemind nodes without the
secret (tests/integration/stranger.py ``eclipse``) join through a member, each with a node id next to the id of
``<run>.peers`` or ``<run>.progress``, and take every store while keeping nothing. Two members train on
configs/synthetic.yaml; the second member's time for ``ROUNDS`` rounds is taken before the strangers came and
after.

Kademlia stores and looks up a key on the nodes nearest it, and hivemind lets a node pick its own id and adds
whoever talks to it to its routing table: undefended (tests/integration/undefended.py ``dht-admission``), the
strangers become where the members store and read both keys, the members stop seeing each other once their
earlier records expire, and they average no more rounds. peerd admits to its routing table only the signers of
records that passed its checks (peerd/swarm/admission.py): no member's table holds a stranger, so no lookup or
store reaches one, and the members average on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from peerd.launcher import wait_for
from tests.helpers import REPO, SYNTHETIC, rounds, time_rounds
from tests.integration.swarms import honest_peer, private

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

RUN = "peerd-synthetic"  # configs/synthetic.yaml
ROUNDS = 40  # more than the members average undefended while the records stored before the strangers live
PER_KEY = 5  # hivemind stores a key on the 5 nodes nearest it


def run(log_dir: Path, undefended: str | None) -> tuple[float, float | None, int, bool]:
    """Returns the second member's seconds for ``ROUNDS`` rounds before the strangers came and after (None: not
    within 3x the first plus 30 s defended, 1.5x plus 10 s undefended), the times its DHT node kept a node out of
    its routing table, and whether it still saw the first member at the end."""
    with private(SYNTHETIC, log_dir) as swarm:
        first = honest_peer(swarm, "member0", undefended)
        first.wait_ready(90)
        member = honest_peer(swarm, "member1", undefended)
        member.wait_ready(90)
        wait_for(lambda: rounds(member) >= 3, 120, "the members to average 3 rounds", 0.5)
        before = time_rounds(member, ROUNDS, 120)
        assert before is not None
        stranger = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.stranger", "eclipse", first.ready["maddrs"][0], str(PER_KEY),
             f"{RUN}.peers", f"{RUN}.progress"], stdout=subprocess.PIPE, cwd=REPO, text=True)
        try:
            assert stranger.stdout is not None
            joined = json.loads(stranger.stdout.readline())
            assert joined["nodes"] == 2 * PER_KEY
            came = rounds(member)
            # undefended, half as long again as before tells the damage: waiting longer only makes the test slower
            after = time_rounds(member, ROUNDS, 1.5 * before + 10 if undefended else 3 * before + 30)
            assert stranger.poll() is None, "the strangers' process ended during the attack"
            status = member.status(timeout=30)
            since = int(status["training"]["rounds_ok"]) - came
        finally:
            stranger.terminate()
            stranger.wait(30)
            if stranger.stdout is not None:
                stranger.stdout.close()
        sees_first = any(p["peer_id"] == first.peer_id for p in status["peers"])
        print(f"undefended={undefended}: {ROUNDS} rounds in {before:.1f} s before the strangers came, "
              f"{after if after is None else round(after, 1)} s after ({since} rounds since they came); the member kept "
              f"nodes out of its routing table {status['dht_peers_kept_out']} times and sees the other "
              f"member: {sees_first}")
        return before, after, int(status["dht_peers_kept_out"]), sees_first


def test_strangers_with_node_ids_next_to_the_swarms_keys_stall_no_round(tmp_path: Path) -> None:
    before, after, kept_out, sees_first = run(tmp_path / "defended", None)
    assert after is not None, before
    assert kept_out > 0 and sees_first
    before, after, kept_out, sees_first = run(tmp_path / "undefended", "dht-admission")
    assert after is None, (before, after)
    assert kept_out == 0
