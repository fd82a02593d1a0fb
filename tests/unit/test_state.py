from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from peerd.config import CheckpointConfig
from peerd.errors import StateError
from peerd.training.checkpoint import Checkpointer
from peerd.training.state import pack_state, unpack_state

FP = "0123456789abcdef"


def model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_round_trip_restores_model_optimizer_and_step() -> None:
    source, source_opt = model_and_optimizer(0)
    target, target_opt = model_and_optimizer(1)
    step = unpack_state(pack_state(source, source_opt, 42, FP), target, target_opt, FP, "test")
    assert step == 42 and same(source, target)
    assert torch.equal(target_opt.state_dict()["state"][0]["exp_avg"], source_opt.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_blobs_are_refused_and_leave_the_model_alone(damage: str) -> None:
    source, source_opt = model_and_optimizer(0)
    blob = pack_state(source, source_opt, 1, FP)
    blob = {"truncate": blob[: len(blob) // 2], "garbage": b"\x00" * 100, "empty": b""}[damage]
    target, target_opt = model_and_optimizer(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(StateError, match="peer-x"):
        unpack_state(blob, target, target_opt, FP, "peer-x")
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_foreign_fingerprint_shape_and_nan_are_refused() -> None:
    source, source_opt = model_and_optimizer(0)
    target, target_opt = model_and_optimizer(1)
    with pytest.raises(StateError, match="another model"):
        unpack_state(pack_state(source, source_opt, 1, "ffffffffffffffff"), target, target_opt, FP, "f")

    other = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    with pytest.raises(StateError, match="wrong type, shape or dtype"):
        unpack_state(pack_state(other, torch.optim.SGD(other.parameters(), lr=1), 1, FP), target, target_opt, FP, "s")

    with torch.no_grad():
        source[0].weight[0, 0] = float("nan")
    with pytest.raises(StateError, match="NaN or Inf"):
        unpack_state(pack_state(source, source_opt, 1, FP), target, target_opt, FP, "n")


def test_checkpoints_are_atomic_pruned_and_fall_back_past_a_truncated_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, optimizer = model_and_optimizer(0)
    checkpointer = Checkpointer(CheckpointConfig(directory=tmp_path, keep=2), tmp_path)
    for step in (10, 20, 30):
        checkpointer.save(pack_state(model, optimizer, step, FP), step)
    assert [p.name for p in checkpointer.files()] == ["ckpt-000000030.pt", "ckpt-000000020.pt"]
    assert not list(tmp_path.glob("*.partial"))

    newest = checkpointer.files()[0]
    newest.write_bytes(newest.read_bytes()[:100])  # e.g. the disk filled up while copying it elsewhere
    target, target_opt = model_and_optimizer(1)
    with caplog.at_level(logging.ERROR):
        assert checkpointer.resume(target, target_opt, FP) == 20
    assert "ckpt-000000030.pt" in caplog.text and same(model, target)


def test_resume_without_checkpoints_and_with_only_bad_ones(tmp_path: Path) -> None:
    model, optimizer = model_and_optimizer(0)
    checkpointer = Checkpointer(CheckpointConfig(directory=tmp_path), tmp_path)
    assert checkpointer.resume(model, optimizer, FP) is None
    (tmp_path / "ckpt-000000001.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(StateError, match="no usable checkpoint"):
        checkpointer.resume(model, optimizer, FP)
