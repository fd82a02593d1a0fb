"""Lockstep mode with real processes: every step averages both peers' fixed shares, bit for bit as one process
training on the union of their samples would (with lossless averaging and the plain weighted mean, since robust
rules scale a pair's rows to the smaller norm; weights of 64 samples make the weighted mean exact up to the one
rounding of the sum, which is commutative for two members)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from peerd.config import TaskConfig, TrainingConfig
from peerd.launcher import LocalSwarm, PeerProcess, wait_for
from peerd.tasks import build_task
from peerd.training.local import make_optimizer
from tests.helpers import REPO, model_in_checkpoint, training

pytestmark = pytest.mark.integration

SYNTHETIC = REPO / "configs" / "synthetic.yaml"
STEPS = 8
SHARE = 64  # two micro-batches of the synthetic task's 32 samples


def reference_parameters(shards: list[int]) -> dict[str, torch.Tensor]:
    """One process, one model: each step the mean of each shard's mean gradient over its next SHARE samples
    (sample-weighted, equal weights), with the optimizer of configs/synthetic.yaml, on one thread like the
    peers (PeerProcess sets OMP_NUM_THREADS=1), so no kernel splits its sums differently."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train_reference(shards)
    finally:
        torch.set_num_threads(threads)


def _train_reference(shards: list[int]) -> dict[str, torch.Tensor]:
    config = TaskConfig(name="synthetic", options={"dim": 32, "batch_size": 32})
    tasks = [build_task(config, shard) for shard in shards]
    model = tasks[0].model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(TrainingConfig(optimizer="sgd", lr=0.1), model)
    streams = [task.train_batches() for task in tasks]
    for _ in range(STEPS):
        means = []
        for task, stream in zip(tasks, streams, strict=True):
            samples = 0
            while samples < SHARE:  # as the trainer accumulates: sums over samples, divided at the end
                batch = next(stream)
                samples += task.samples_in(batch)
                (task.loss(model, batch) * task.samples_in(batch)).backward()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            means.append(torch.cat([g.reshape(-1) for g in grads]).div_(samples))
            optimizer.zero_grad(set_to_none=True)
        average = torch.stack(means).mean(0)
        offset = 0
        for p in params:
            p.grad = average[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    args = ["-o", f"training.samples_per_step={SHARE}", "-o", "training.wait_for_peers=2",
            "-o", "averaging.codec.lossless=true",
            "-o", "averaging.aggregation=mean", "-o", f"training.max_steps={STEPS}",
            "-o", f"training.checkpoint.every_steps={STEPS}"]
    with LocalSwarm(SYNTHETIC, log_dir=tmp_path, extra_args=args) as local_swarm:
        yield local_swarm


def rounds(peer: PeerProcess) -> list[dict[str, Any]]:
    """The peer's last averaging rounds (``/history``), oldest first."""
    return list(peer.history(points=1)["rounds"])


@pytest.mark.timeout(90)
def test_two_peers_in_lockstep_average_fixed_shares_every_step(swarm: LocalSwarm, tmp_path: Path) -> None:
    shards = [0, 1]
    for shard in shards:
        args = ["-o", f"training.task.shard_index={shard}",
                "-o", f"training.checkpoint.directory={tmp_path / f'shard{shard}'}"]
        peer = swarm.spawn_peer(args)
        if shard == 0:
            peer.wait_ready(60)
    for peer in swarm.peers:
        peer.wait_ready(60)
    checkpoints = [tmp_path / f"shard{shard}" / f"ckpt-{STEPS:09d}.pt" for shard in shards]
    wait_for(lambda: all(path.is_file() for path in checkpoints), 60, f"both peers' checkpoints at step {STEPS}", 0.2)

    for peer in swarm.peers:
        report = training(peer)
        assert (report["rounds_ok"], report["rounds_solo"], report["state_syncs"]) == (STEPS, 0, 0), report
        history = rounds(peer)
        assert [r["step"] for r in history] == list(range(STEPS))
        assert all(r["group_size"] == 2 and r["samples"] == SHARE for r in history), history
    finals = [model_in_checkpoint(path) for path in checkpoints]
    expected = reference_parameters(shards)
    for name, tensor in expected.items():
        assert torch.equal(finals[0][name], finals[1][name]), f"{name} differs between the peers"
        assert torch.equal(finals[0][name], tensor), (
            f"{name}: max deviation from one-process training {float((finals[0][name] - tensor).abs().max()):.2e}"
        )
    assert swarm.stop() == [0, 0]


@pytest.mark.timeout(90)
def test_a_killed_peer_stalls_its_lockstep_partner_only_for_a_bounded_time(tmp_path: Path) -> None:
    args = ["-o", f"training.samples_per_step={SHARE}", "-o", "training.wait_for_peers=2",
            "-o", "training.max_steps=200", "-o", "training.progress_ttl=3",
            "-o", "averaging.round_timeout=4", "-o", "averaging.join_timeout=2"]
    with LocalSwarm(SYNTHETIC, log_dir=tmp_path, extra_args=args) as local_swarm:
        survivor = local_swarm.add_peer(["-o", "training.task.shard_index=0"])
        victim = local_swarm.add_peer(["-o", "training.task.shard_index=1"])
        wait_for(lambda: training(survivor)["rounds_ok"] >= 3, 60, "3 lockstep rounds", 0.2)
        victim.proc.kill()
        victim.proc.wait(10)
        step = training(survivor)["step"]
        # Killed while computing, the victim is waited for until its progress record expires (3 s); killed
        # mid-round, it is excluded after averaging.round_timeout (4 s). Either way the survivor goes on alone.
        wait_for(lambda: training(survivor)["step"] >= step + 5, 30, "5 more steps without the victim", 0.2)
        assert training(survivor)["rounds_solo"] >= 1
        assert survivor.stop() == 0
