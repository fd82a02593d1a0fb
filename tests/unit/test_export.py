"""peerd export: checkpoints of the hf task become directories from_pretrained (or peft) loads, other tasks'
become model.safetensors and task.json; diloco exports the shared parameters; bad input loses nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from peerd.config import TaskConfig, TrainingConfig
from peerd.errors import ConfigError
from peerd.tasks import Task, build_task
from peerd.training.checkpoint import Checkpointer
from peerd.training.diloco import DilocoMode, OuterState
from peerd.training.export import artifacts_directory, export_checkpoint
from peerd.training.local import LocalModel
from peerd.training.modes import SyncMode
from tests.hf_models import TINY_LLAMA, sentences, tokenizer_and_model, write_text

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    assets = tokenizer_and_model(tmp_path_factory.mktemp("export"))
    return {**assets, "text": write_text(assets["root"] / "data.txt", sentences(400))}


def hf_config(assets: dict[str, Path], **overrides: Any) -> TaskConfig:
    options = {"config": dict(TINY_LLAMA), "tokenizer": str(assets["tokenizer"]), "seq_len": 32, "batch_size": 4,
               "val_batches": 1, "data": {"files": [str(assets["text"])]}, **overrides}
    return TaskConfig(name="hf", options=options, num_shards=2)


def train_and_checkpoint(config: TaskConfig, directory: Path, mode: str = "sync", steps: int = 3) -> tuple[
        Task, LocalModel, OuterState | None]:
    """A few local steps of ``config``'s task, then a checkpoint in ``directory`` as the trainer writes it."""
    training = TrainingConfig(enabled=True, task=config, mode=mode)  # type: ignore[arg-type]
    task = build_task(config, 0)
    local = LocalModel(training, task, error_feedback=False)
    host = SimpleNamespace(config=training, local=local)  # what of a trainer a mode's state methods use
    trainer_mode = DilocoMode(host) if mode == "diloco" else SyncMode(host)  # type: ignore[arg-type]
    outer = trainer_mode.outer if isinstance(trainer_mode, DilocoMode) else None
    batches = task.train_batches()
    for _ in range(steps):
        _, samples = local.forward_backward(next(batches))
        local.inner_step(samples)
    if outer is not None:  # an outer round moved the shared parameters; the local ones went on from there
        averaged = outer.end_phase().clone()
        outer.step(averaged)
        for _ in range(steps):
            _, samples = local.forward_backward(next(batches))
            local.inner_step(samples)
    meta = {"task": config.model_dump(mode="json"), "parameters": local.param_names}
    task.save_artifacts(artifacts_directory(directory, task.fingerprint))
    Checkpointer(training.checkpoint, directory, meta).save(trainer_mode.capture(7), task.fingerprint)
    return task, local, outer


def test_a_full_run_exports_what_from_pretrained_loads_and_it_generates(assets: dict[str, Path], tmp_path: Path) -> None:
    task, _, _ = train_and_checkpoint(hf_config(assets), tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    exported = model.state_dict()
    for name, tensor in task.model.state_dict().items():
        assert torch.equal(exported[name], tensor), name
    generated = model.generate(**tokenizer("peer swarm", return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > 2
    assert json.loads((tmp_path / "out" / "task.json").read_text())["step"] == 7


def test_diloco_exports_the_shared_parameters_not_the_peers_own(assets: dict[str, Path], tmp_path: Path) -> None:
    _, local, outer = train_and_checkpoint(hf_config(assets), tmp_path / "ckpt", mode="diloco")
    assert outer is not None
    export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    flat = torch.cat([exported[name].reshape(-1) for name in local.param_names])
    assert torch.equal(flat, outer.shared)
    assert not torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in local.params]))


def test_lora_exports_the_adapter_and_with_merge_the_merged_model(assets: dict[str, Path], tmp_path: Path) -> None:
    config = hf_config(assets, config=None, tokenizer=None, model=str(assets["model"]), lora={"r": 2})
    task, _, _ = train_and_checkpoint(config, tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "adapter")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "merged", merge=True)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets["model"]), tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    tokens = next(task.train_batches())
    task.model.eval()
    expected = task.model(input_ids=tokens).logits
    assert torch.allclose(with_adapter.eval()(input_ids=tokens).logits, expected, atol=1e-5)
    assert torch.allclose(merged.eval()(input_ids=tokens).logits, expected, atol=1e-4)
    assert (tmp_path / "merged" / "adapter" / "adapter_config.json").is_file()


def test_other_tasks_export_safetensors_and_their_config(tmp_path: Path) -> None:
    config = TaskConfig(name="synthetic", options={"dim": 4})
    task, _, _ = train_and_checkpoint(config, tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert weights.keys() == task.model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in task.model.state_dict().items())
    assert json.loads((tmp_path / "out" / "task.json").read_text())["task"]["name"] == "synthetic"
    with pytest.raises(ConfigError, match="--merge applies to LoRA runs"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out2", merge=True)
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out2.partial").exists()


def test_bad_input_is_one_line_exit_1_and_writes_nothing(tmp_path: Path) -> None:
    train_and_checkpoint(TaskConfig(name="synthetic", options={"dim": 4}), tmp_path / "ckpt")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "none").mkdir()
    cases = [
        (["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o1")], "no such directory"),
        (["--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "o2")], "holds no checkpoint"),
        (["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o3"), "--step", "5"],
         "--step 5: no checkpoint of that step"),
        (["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "full")], "is not an empty directory"),
    ]
    for args, words in cases:
        result = subprocess.run([sys.executable, "-m", "peerd", "export", *args], capture_output=True, text=True,
                                timeout=60, check=False)
        assert result.returncode == 1, result
        assert words in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "full", "none"]
