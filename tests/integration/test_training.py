"""Real processes training together: convergence, identical parameters, bytes, faults, late joiners."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from peerd.config import TaskConfig
from peerd.launcher import LocalSwarm, wait_for
from peerd.tasks import build_task
from tests.helpers import REPO, all_reached, model_in_checkpoint, ready_peer, training

pytestmark = pytest.mark.integration

SYNTHETIC = REPO / "configs" / "synthetic.yaml"
# ~8k parameters, so per-round headers are negligible next to the payload; the MSE is averaged over the 8
# outputs, hence the larger learning rate (contraction 1 - 2 * lr / out_dim per step).
OPTIONS = {"dim": 1024, "out_dim": 8, "batch_size": 32}
TASK_ARGS = ["-o", "training.task.options={dim: 1024, out_dim: 8, batch_size: 32}", "-o", "training.lr=1.0",
             "-o", "training.wait_for_peers=3"]


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    with LocalSwarm(SYNTHETIC, log_dir=tmp_path, extra_args=TASK_ARGS) as local_swarm:
        yield local_swarm


@pytest.mark.timeout(240)
def test_three_peers_converge_to_the_optimum_with_identical_parameters(swarm: LocalSwarm, tmp_path: Path) -> None:
    steps = 80  # at 60, a run whose centered_clip clipped one member in every round ended at 0.063
    def args(name: str) -> list[str]:
        return ["-o", f"training.max_steps={steps}", "-o", f"training.checkpoint.every_steps={steps}",
                "-o", f"training.checkpoint.directory={tmp_path / name}"]

    swarm.add_peer(args("peer0"))
    for name in ("peer1", "peer2"):
        swarm.spawn_peer(args(name))
    for peer in swarm.peers:
        peer.wait_ready(60)
    wait_for(lambda: all_reached(swarm.peers, "step", steps), 180, f"all peers to reach step {steps}", 0.5)

    task = build_task(TaskConfig(name="synthetic", options=OPTIONS), shard_index=0)
    assert task.optimum is not None
    finals = []
    for peer in swarm.peers:
        report = training(peer)
        assert report["rounds_ok"] >= 20, report  # most steps were averaged in a group, not taken alone
        # ~1 byte per parameter and element sent (8-bit codes + bf16 scales), not 4 as with fp32:
        # per round a member sends (n-1)/n of the gradient as contributions and (n-1)/n back as averages.
        size = report["last_round"]["group_size"]
        per_element = report["bytes_sent"] / report["rounds_ok"] / (2 * (size - 1) / size * report["parameters"])
        assert per_element < 1.2, (per_element, report)
        path = tmp_path / peer.name / f"ckpt-{steps:09d}.pt"
        wait_for(path.is_file, 30, f"{peer.name}'s checkpoint (written after validation)", 0.2)
        finals.append(model_in_checkpoint(path))
    for final in finals:
        error = (final["weight"] - task.optimum["weight"]).norm() / task.optimum["weight"].norm()
        assert error < 0.05, f"did not converge: relative error {float(error):.3f}"
        for name, tensor in final.items():
            assert torch.allclose(tensor, finals[0][name], atol=2e-3), f"{name} differs across peers"
    assert swarm.stop() == [0, 0, 0]


@pytest.mark.timeout(240)
def test_sigkill_of_one_peer_mid_training_the_others_keep_averaging(swarm: LocalSwarm) -> None:
    swarm.start(3)
    survivors, victim = swarm.peers[:2], swarm.peers[2]
    wait_for(lambda: all_reached(swarm.peers, "rounds_ok", 5), 120, "5 averaged rounds on every peer", 0.5)
    victim.proc.kill()
    victim.proc.wait(10)
    before = {p.name: training(p)["rounds_ok"] for p in survivors}
    wait_for(
        lambda: all(training(p)["rounds_ok"] >= before[p.name] + 5 for p in survivors), 120,
        "5 more rounds on both survivors", 0.5,
    )
    for peer in survivors:
        report = training(peer)
        assert report["last_round"]["group_size"] == 2
        assert report["loss"] is not None and math.isfinite(report["loss"])
    assert [p.stop() for p in survivors] == [0, 0]


@pytest.mark.timeout(240)
def test_late_joiner_downloads_state_before_training(swarm: LocalSwarm) -> None:
    swarm.extra_args[-1] = "training.wait_for_peers=2"
    swarm.start(2)
    wait_for(lambda: all_reached(swarm.peers, "step", 30), 120, "the first two peers to reach step 30", 0.5)
    late = swarm.add_peer()
    report = training(late)
    assert report["state_syncs"] >= 1
    log = late.log_path.read_text()
    loaded = [line for line in log.splitlines() if "Loaded training state at step" in line]
    assert loaded, log[-2000:]
    assert int(loaded[0].split("at step ")[1].split()[0]) >= 30  # never restarts the swarm from step 0
    wait_for(lambda: training(late)["rounds_ok"] >= 3, 90, "the late joiner to average with the others", 0.5)
    assert swarm.stop() == [0, 0, 0]


@pytest.mark.timeout(180)
def test_a_peer_with_another_model_is_named_and_refused(swarm: LocalSwarm) -> None:
    swarm.extra_args[-1] = "training.wait_for_peers=2"
    swarm.start(2)
    odd = swarm.add_peer(["-o", "training.task.seed=7"])
    good = swarm.peers[0]
    wait_for(lambda: odd.peer_id in training(good)["foreign_peers"], 30, "the odd peer to be flagged", 0.5)
    wait_for(lambda: "trains a different model/config" in good.log_path.read_text(), 10, "an error log line")
    before = training(odd)["rounds_ok"]
    wait_for(lambda: training(good)["rounds_ok"] >= 5, 60, "the matching peers to keep averaging", 0.5)
    assert training(odd)["rounds_ok"] == before == 0
    assert swarm.stop() == [0, 0, 0]


@pytest.mark.timeout(120)
def test_resume_continues_from_the_last_checkpoint(tmp_path: Path) -> None:
    args = ["--config", str(SYNTHETIC), *TASK_ARGS[:-2], "-o", f"training.checkpoint.directory={tmp_path / 'ck'}",
            "-o", "training.checkpoint.every_steps=10"]
    with ready_peer("first", [*args, "-o", "training.max_steps=20"], tmp_path) as first:
        wait_for(lambda: training(first)["step"] >= 20, 60, "20 solo steps", 0.2)
        assert first.stop() == 0
    assert (tmp_path / "ck" / "ckpt-000000020.pt").is_file()

    with ready_peer("second", [*args, "-o", "training.max_steps=25", "--resume"], tmp_path) as second:
        assert training(second)["step"] >= 20  # not back at step 0
        wait_for(lambda: training(second)["step"] >= 25, 60, "5 more steps", 0.2)
        assert "Resumed from" in second.log_path.read_text()
        assert second.stop() == 0
