"""A stranger's slot attack, with real processes: 5 identities without the secret open 16 streams each to a
trainer's averaging handler and say nothing (tests/integration/stranger.py), re-opening every stream the
trainer closes or refuses. The trainer's member slots are cut to 64 (swarm.streams.max_streams): the strangers'
80 streams take every slot when a stream's slot is taken before its handshake, and the 16 left over wait to
take any slot that frees, as an attacker would keep them (with exactly 64, a slot a member's stream held at
the attack's start stayed the member's, round after round).

peerd keeps unproven streams in a pool of their own (4 per peer), and disconnects each stranger once 16 of its
streams were refused: the two members average on as before.
The same attack against ``tests/integration/undefended.py`` with one pool for both shows the damage: the
member's streams to the victim are refused as busy and its rounds stop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peerd.averaging.allreduce import HANDLER_NAME
from peerd.launcher import PeerProcess, wait_for
from tests.helpers import REPO, rounds, time_rounds
from tests.integration.swarms import private

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

SYNTHETIC = REPO / "configs" / "synthetic.yaml"
ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
# members' handshake deadline outlasts the test: without the defence each stranger's stream holds a member's
# slot until that deadline, and the strangers' streams, opened together, would expire together and leave the
# member a window to average through while they reopen
LIMITS = ["-o", "swarm.streams.max_streams=64", "-o", "swarm.streams.max_streams_per_peer=16",
          "-o", "swarm.streams.handshake_timeout=300"]
IDENTITIES, STREAMS = 5, 16
ROUNDS = 5


def run(log_dir: Path, undefended: bool) -> tuple[float, float | None, dict[str, int]]:
    """Two members train; once they averaged, the strangers attack the second. Returns the seconds the second
    member took for ROUNDS rounds before the attack and under it (None: not within 3x as long plus 30 s), and
    what it refused meanwhile."""
    with private(SYNTHETIC, log_dir, *LIMITS) as swarm:
        swarm.add_peer(timeout=90)
        victim_args = ["--config", str(SYNTHETIC), "--control-port", "0", *swarm.extra_args,
                       "--initial-peers", swarm.peers[0].ready["maddrs"][0]]
        if undefended:
            victim_args += ["--undefended", "stream-pools"]
        victim = PeerProcess("victim", victim_args, log_dir, env=ENV,
                             module="tests.integration.undefended" if undefended else "peerd")
        swarm.peers.append(victim)
        victim.wait_ready(90)
        wait_for(lambda: rounds(victim) >= 3, 120, "the members to average 3 rounds", 0.5)
        baseline = time_rounds(victim, ROUNDS, 120)
        assert baseline is not None
        stranger = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.stranger", "slots", victim.ready["maddrs"][0], str(IDENTITIES),
             str(STREAMS), HANDLER_NAME], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
            env={**os.environ, **ENV})
        try:
            assert stranger.stdout is not None
            ready = json.loads(stranger.stdout.readline())
            # the strangers' streams reach the victim's handler after they opened on their side: time the
            # rounds once they hold the pool they aim at (member slots without the defence); defended, they never
            # hold the unproven pool for long: each identity is disconnected once 16 of its streams were refused
            if undefended:
                wait_for(lambda: victim.status(timeout=30)["membership"]["streams_open"] >= 64, 60,
                         "the strangers to hold the victim's 64 member slots", 0.2)
            else:
                wait_for(lambda: victim.status(timeout=30)["membership"]["peers_disconnected"] >= IDENTITIES, 60,
                         f"the victim to disconnect the {IDENTITIES} strangers", 0.2)
            if undefended:
                # the count includes any member's stream open at that moment: its slot goes to the strangers'
                # spare streams once it frees, and the member's refusal says they hold the rest
                member = swarm.peers[0].peer_id
                wait_for(lambda: member in victim.status(timeout=30)["membership"]["refused_peers"], 60,
                         "the victim to refuse a member's stream", 0.2)
            refused_before = dict(victim.status(timeout=30)["membership"]["streams_refused"])
            attacked = time_rounds(victim, ROUNDS, 3 * baseline + 30)
            # an attacker that died mid-attack would make the undefended run look defended
            assert stranger.poll() is None, "the strangers' process ended during the attack"

            def refusals() -> dict[str, int] | None:
                refused = victim.status(timeout=30)["membership"]["streams_refused"]
                delta = {k: v - refused_before.get(k, 0) for k, v in refused.items() if v != refused_before.get(k, 0)}
                # defended, the strangers' streams end without a handshake or are refused as busy; undefended,
                # the member's own streams are refused as busy
                seen = delta.get("busy") if undefended else delta.get("malformed") or delta.get("busy")
                return delta if seen else None

            delta = wait_for(refusals, 60, "the strangers' streams to be refused", 0.5)
        finally:
            stranger.terminate()
            stranger.wait(30)
            assert stranger.stdout is not None
            stranger.stdout.close()
        print(f"undefended={undefended}: strangers held {ready['holding']} streams; {ROUNDS} rounds of the member "
              f"took {baseline:.1f} s before, {attacked} s under attack; refused meanwhile {delta}")
        return baseline, attacked, delta


def test_strangers_cannot_take_members_stream_slots(tmp_path: Path) -> None:
    _, attacked, refused = run(tmp_path / "defended", undefended=False)
    assert attacked is not None, "the member stopped averaging under the strangers' attack"
    _, attacked, refused = run(tmp_path / "undefended", undefended=True)
    assert attacked is None, f"one pool for all: the member still averaged {ROUNDS} rounds in {attacked} s"
    assert refused.get("busy", 0) > 0  # the strangers' spare streams, and the member's
