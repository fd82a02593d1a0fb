"""Robust aggregation's degenerate cases, with real processes, on the synthetic task in lockstep mode (as in
test_robust_averaging.py: shards in order, the last member, honest, reduces the only non-empty span).

- Sybils: two processes of one attacker (tests/integration/sybil.py) send the same row, 1000 in every
  coordinate, among two honest members. Counted as two members, half the rows are identical: CenteredClip's
  radius is 0 and their row is the result. Counted as one, it is clipped like any outlier: the honest
  members' validation loss stays within 10% of an attack-free run.
- A group of 2: the attacker of tests/integration/attacker.py (-1000x its gradient, 10x the samples claimed)
  and one honest member. Averaged with capped weights only, the attacker's half of the weight blows the
  model up; with each row scaled to the smaller norm it can cancel the honest step at worst: the loss stays
  finite, over 100x below the undefended run's.

Each attack runs against peerd and against a swarm with the defence switched off in every peer, attackers
included (tests/integration/undefended.py): each peer checks its reducers' statements by the rule it applies.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from peerd.launcher import LocalSwarm, PeerProcess, wait_for
from tests.helpers import LR, PATCHED_ENV, SHARE, SYNTHETIC, validated_or_diverged, validation_loss

pytestmark = pytest.mark.integration

STEPS = 30
MODULES = {"honest": "peerd", "sybil": "tests.integration.sybil", "attacker": "tests.integration.attacker"}


def spawn(swarm: LocalSwarm, shard: int, role: str, undefended: str | None) -> PeerProcess:
    args = ["--config", str(swarm.config_path), "--control-port", "0", *swarm.extra_args,
            "-o", f"training.task.shard_index={shard}"]
    if swarm.peers:
        args += ["--initial-peers", swarm.peers[0].ready["maddrs"][0]]
    module = MODULES[role]
    if undefended is not None:  # the whole swarm without the defence, attackers included: they check it too
        module = "tests.integration.undefended" if role == "honest" else module
        args = [*args, "--undefended", undefended]
    peer = PeerProcess(f"peer{shard}-{role}", args, swarm.log_dir, env=PATCHED_ENV, module=module)
    swarm.peers.append(peer)
    return peer


def train(log_dir: Path, roles: list[str], aggregation: str = "centered_clip",
          undefended: str | None = None) -> list[dict[str, Any]]:
    """One peer per role, on shards 0.. in order, to step STEPS (or until the honest model is no longer
    finite); returns the honest peers' training reports."""
    args = ["-o", f"training.samples_per_step={SHARE}", "-o", f"training.lr={LR}",
            "-o", f"training.wait_for_peers={len(roles)}", "-o", f"training.max_steps={STEPS}",
            "-o", f"averaging.aggregation={aggregation}", "-o", f"averaging.target_group_size={len(roles)}"]
    log_dir.mkdir(parents=True, exist_ok=True)
    with LocalSwarm(SYNTHETIC, log_dir=log_dir, extra_args=args) as swarm:
        for shard, role in enumerate(roles):
            peer = spawn(swarm, shard, role, undefended)
            if shard == 0:
                peer.wait_ready(60)
        for peer in swarm.peers:
            peer.wait_ready(60)
        honest = [p for p in swarm.peers if p.name.endswith("-honest")]
        reports = wait_for(lambda: validated_or_diverged(honest, STEPS), 200, f"{STEPS} steps of {roles} (undefended: {undefended})", 0.5)
        print(f"{roles} {aggregation} undefended={undefended}: validation losses "
              f"{[validation_loss(r) for r in reports]}")
        return reports


@pytest.mark.timeout(900)
def test_sybils_sending_identical_rows_count_as_one_member(tmp_path: Path) -> None:
    reference = validation_loss(train(tmp_path / "reference", ["honest"] * 4, "mean")[0])
    assert reference is not None and math.isfinite(reference)
    roles = ["sybil", "sybil", "honest", "honest"]
    defended = [validation_loss(r) for r in train(tmp_path / "defended", roles)]
    assert all(loss is not None and abs(loss / reference - 1) <= 0.10 for loss in defended), (defended, reference)
    undefended = [validation_loss(r) for r in train(tmp_path / "undefended", roles, undefended="identical-rows")]
    assert all(loss is None or not loss <= 10 * reference for loss in undefended), (undefended, reference)


@pytest.mark.timeout(900)
def test_in_a_group_of_two_neither_side_has_the_last_word(tmp_path: Path) -> None:
    roles = ["attacker", "honest"]
    (defended,) = train(tmp_path / "defended", roles)
    (undefended,) = train(tmp_path / "undefended", roles, undefended="pair-norms")
    loss, blown = validation_loss(defended), validation_loss(undefended)
    assert loss is not None and math.isfinite(loss) and defended["rounds_ok"] >= STEPS - 2, defended
    assert blown is None or blown > 100 * loss, (loss, blown)
