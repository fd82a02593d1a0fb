"""A member that lies about its progress and serves a false state, with real processes: it claims a step 30,000
ahead of the swarm and serves finite noise (or noise with one NaN) of the right shapes as its state
(tests/integration/state_attacker.py). Without the checks of claims (tests/integration/undefended.py: honest
peers that believe every member's word) the honest members load the noise and jump to its step, or try the
NaN state again at every micro-step; with them, the honest members train exactly as without the attacker (the
validation loss of an attack-free run at the same step), never ask it for anything, list its claim as
unbelieved, and a joiner that the attacker then lures (it claims to be one step ahead, names the state the
honest members vouch for, and serves noise under their pieces' digests) catches it on the first piece, excludes
it, and loads the honest state from another member. Nobody excludes an honest member.

The synthetic task in lockstep mode (two micro-batches of 32 samples per peer per step, honest shards 1-3), so
every run sees the same samples and an attacked run can be compared with the attack-free one step for step.
The attacker takes part in no round, so only its claims differ from the attack-free run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from peerd.launcher import LocalSwarm, PeerProcess, wait_for
from tests.helpers import PATCHED_ENV, REPO, training
from tests.integration.state_attacker import LEAD

pytestmark = pytest.mark.integration

SYNTHETIC = REPO / "configs" / "synthetic.yaml"
STEPS = 30
SHARE = 64
HONEST = (1, 2, 3)  # data shards of the honest members
ARGS = ["-o", f"training.samples_per_step={SHARE}", "-o", "training.lr=0.2", "-o", f"training.max_steps={STEPS}",
        "-o", "averaging.target_group_size=4"]


def spawn(swarm: LocalSwarm, name: str, module: str, shard: int, *extra: str,
          env: dict[str, str] | None = None) -> PeerProcess:
    args = ["--config", str(swarm.config_path), "--control-port", "0", *swarm.extra_args,
            "-o", f"training.task.shard_index={shard}", *extra]
    if module == "tests.integration.undefended":
        args += ["--undefended", "claims"]
    if swarm.peers:
        args += ["--initial-peers", swarm.peers[0].ready["maddrs"][0]]
    peer = PeerProcess(name, args, swarm.log_dir, env={**PATCHED_ENV, **(env or {})}, module=module)
    swarm.peers.append(peer)
    return peer


def validation_loss(report: dict[str, Any]) -> float:
    loss = report["validation_loss"]
    return math.inf if loss is None or not math.isfinite(loss) else float(loss)


def start(swarm: LocalSwarm, honest_module: str, attack: str | None, claim_file: Path) -> list[PeerProcess]:
    """The honest members (and the attacker, if any), all up; returns the honest ones."""
    wanted = len(HONEST) + (attack is not None)
    extra = ("-o", f"training.wait_for_peers={wanted}")
    honest = []
    for i, shard in enumerate(HONEST):
        honest.append(spawn(swarm, f"honest{shard}", honest_module, shard, *extra))
        if i == 0:
            honest[0].wait_ready(READY_TIMEOUT)
    if attack is not None:
        spawn(swarm, "attacker", "tests.integration.state_attacker", 0, *extra,
              env={"PEERD_ATTACK_STATE": attack, "PEERD_ATTACK_CLAIM_FILE": str(claim_file)})
    for peer in swarm.peers:
        peer.wait_ready(READY_TIMEOUT)
    return honest


# A peer is ready once its trainer has started: with training.wait_for_peers, after the others are up too (five
# peers starting at once), and for an undefended peer after it loaded the attacker's state. Near the end of a CI
# run with three test processes, one took over 60 s.
READY_TIMEOUT = 150.0


def finished(honest: list[PeerProcess]) -> list[dict[str, Any]] | None:
    reports = [training(p) for p in honest]
    return reports if all(r["state"] == "idle" for r in reports) else None


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[float]:
    log_dir = tmp_path_factory.mktemp("reference")
    with LocalSwarm(SYNTHETIC, log_dir=log_dir, extra_args=ARGS) as swarm:
        honest = start(swarm, "peerd", None, log_dir / "claim")
        reports = wait_for(lambda: finished(honest), 240, f"{STEPS} attack-free steps", 0.5)
    losses = {validation_loss(r) for r in reports}
    assert len(losses) == 1 and all(r["validation_step"] == STEPS for r in reports), reports
    yield losses.pop()


def check_undefended_damage(attack: str, log_dir: Path, reference: float) -> None:
    log_dir.mkdir(parents=True)
    with LocalSwarm(SYNTHETIC, log_dir=log_dir, extra_args=ARGS) as swarm:
        honest = start(swarm, "tests.integration.undefended", attack, log_dir / "claim")
        if attack == "noise":  # they load the noise at the attacker's step, past max_steps, and stop there
            reports = wait_for(lambda: finished(honest), 240, "the undefended peers to take the noise", 0.5)
            for r in reports:
                assert r["state_syncs"] >= 1 and r["step"] >= LEAD, r
                assert not abs(validation_loss(r) / reference - 1) <= 0.10, (validation_loss(r), reference)
        else:  # the NaN state is refused, and asked for again at every micro-step
            wait_for(lambda: all(training(p)["state_sync_failures"] >= 3 for p in honest), 240,
                     "the undefended peers to try the NaN state 3 times each", 0.5)
        print(f"{attack}, undefended:", [{k: training(p)[k] for k in ("step", "state_syncs", "state_sync_failures",
                                                                      "validation_loss")} for p in honest])


def check_defended(attack: str, log_dir: Path, reference: float) -> None:
    claim_file = log_dir / "claim"
    log_dir.mkdir(parents=True)
    with LocalSwarm(SYNTHETIC, log_dir=log_dir, extra_args=ARGS) as swarm:
        honest = start(swarm, "peerd", attack, claim_file)
        attacker = next(p for p in swarm.peers if p.name == "attacker")
        reports = wait_for(lambda: finished(honest), 240, f"{STEPS} steps beside the attacker", 0.5)
        for r in reports:
            assert r["step"] == r["validation_step"] == STEPS, r
            assert abs(validation_loss(r) / reference - 1) <= 0.10, (validation_loss(r), reference)
            assert r["state_syncs"] == r["state_sync_failures"] == r["claims"]["steps_adopted"] == 0, r
            assert attacker.peer_id in r["claims"]["unbelieved"] and r["claims"]["excluded"] == {}, r["claims"]
        assert training(attacker)["state_transfer"]["serve"]["transfers_served"] == 0  # nobody asked it

        # the lure: the attacker names the honest members' state, and serves noise under its pieces' digests
        claim_file.write_text("mimic")
        wait_for(lambda: attacker.peer_id in (training(honest[0])["claims"]["vouched"] or {}).get("members", []),
                 60, "the attacker to vouch for the honest state", 0.5)
        joiner = spawn(swarm, "joiner", "peerd", 4, "-o", "training.wait_for_peers=1")
        joiner.wait_ready(90)
        late = wait_for(lambda: finished([joiner]), 120, "the joiner to load the state and validate", 0.5)[0]
        assert late["state_syncs"] == 1 and late["step"] == STEPS, late
        assert set(late["claims"]["excluded"]) == {attacker.peer_id}, late["claims"]
        assert late["state_transfer"]["download"]["bytes_from"].get(attacker.peer_id, 0) > 0, late
        assert validation_loss(late) == validation_loss(reports[0]), (late["validation_loss"], reports[0])
        for peer in honest:  # nobody excludes an honest member
            assert training(peer)["claims"]["excluded"] == {}
        print(f"{attack}, defended: loss {validation_loss(reports[0]):.6g} (attack-free {reference:.6g}); the "
              f"joiner excluded the attacker: {late['claims']['excluded']}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("attack", ["noise", "nan"])
def test_a_member_claiming_to_be_far_ahead_with_a_false_state_takes_nobody(
    reference: float, tmp_path: Path, attack: str
) -> None:
    check_undefended_damage(attack, tmp_path / "undefended", reference)
    check_defended(attack, tmp_path / "defended", reference)
