"""The hf task: models from a directory or a config, the streaming data pipeline (formats, shards, validation),
LoRA, and a clear error for every bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from peerd.config import TaskConfig, TrainingConfig
from peerd.errors import ConfigError
from peerd.tasks import build_task
from peerd.tasks.hf.task import HFTask
from peerd.training.local import LocalModel
from tests.hf_models import (
    TINY_LLAMA,
    make_model,
    sentences,
    tokenizer_and_model,
    write_jsonl,
    write_parquet,
    write_text,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    assets = tokenizer_and_model(tmp_path_factory.mktemp("hf"))
    root, lines = assets["root"], sentences(1200)
    return {
        **assets,
        "text": write_text(root / "data" / "a.txt", lines[:600]),
        "text2": write_text(root / "data" / "b.txt", lines[600:]),
        "jsonl": write_jsonl(root / "data" / "c.jsonl", lines),
        "parquet": write_parquet(root / "data" / "d.parquet", lines),
    }


def options(assets: dict[str, Path], **overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "config": dict(TINY_LLAMA), "tokenizer": str(assets["tokenizer"]),
        "data": {"files": [str(assets["root"] / "data" / "*.txt")], "text_block_chars": 256},
        "seq_len": 32, "batch_size": 4, "val_batches": 2,
    }
    base.update(overrides)
    return base


def build(opts: dict[str, Any], shard: int = 0, num_shards: int = 4, seed: int = 0) -> HFTask:
    task = build_task(TaskConfig(name="hf", options=opts, num_shards=num_shards, seed=seed), shard)
    assert isinstance(task, HFTask)
    return task


def test_from_config_same_model_and_fingerprint_on_every_shard_and_seed_decides(assets: dict[str, Path]) -> None:
    rng = torch.random.get_rng_state()
    a, b = build(options(assets), shard=0), build(options(assets), shard=3)
    assert torch.equal(torch.random.get_rng_state(), rng), "building must not consume torch's RNG"
    assert a.fingerprint == b.fingerprint
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    other = build(options(assets), seed=1)
    assert other.fingerprint != a.fingerprint
    assert not torch.equal(other.model.state_dict()["lm_head.weight"], a.model.state_dict()["lm_head.weight"])
    batch = next(a.train_batches())
    assert batch.shape == (4, 32) and batch.dtype == torch.long
    assert a.tokens_per_sample == 32
    assert all(v.shape == (4, 32) for v in a.validation_batches())


def test_pretrained_directory_and_its_revision_are_in_the_fingerprint(assets: dict[str, Path], tmp_path: Path) -> None:
    pretrained = options(assets, config=None, model=str(assets["model"]), tokenizer=None)
    task = build(pretrained)
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(assets["model"]).state_dict()
    assert all(torch.equal(saved[k], v) for k, v in task.model.state_dict().items())
    # the same weights elsewhere on disk are the same model; another revision (other weights) is not
    copy = make_model(tmp_path / "copy", tokenizer=assets["tokenizer"])
    assert build({**pretrained, "model": str(copy)}).fingerprint == task.fingerprint
    revised = make_model(tmp_path / "revised", seed=5, tokenizer=assets["tokenizer"])
    assert build({**pretrained, "model": str(revised)}).fingerprint != task.fingerprint


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet"])
def test_shards_are_disjoint_cover_the_data_and_never_see_validation(assets: dict[str, Path], kind: str) -> None:
    files = [str(assets["root"] / "data" / "*.txt")] if kind == "text" else [str(assets[kind])]
    opts = options(assets, data={"files": files, "text_block_chars": 256, "shuffle_buffer": 1, "val_every": 7})
    shards = 3
    tasks = [build(opts, shard=s, num_shards=shards) for s in range(shards)]
    corpus = tasks[0].corpus
    records = [text for text, _ in corpus.records()]
    held_out = [i for i in range(len(records)) if corpus.held_out(i)]
    training = [i for i in range(len(records)) if not corpus.held_out(i)]
    assert held_out and held_out == list(range(0, held_out[-1] + 1, 7)), "every 7th record from the start"
    assert len(training) > 10 * len(held_out)

    def tokens(indices: list[int]) -> list[int]:
        return [t for i in indices for t in next(corpus._tokenize([(records[i], kind != "text")]))]

    for shard in range(shards):
        mine = training[shard::shards]
        # in order (shuffle_buffer 1): this shard's sequences are its records' tokens, packed
        got = [t for seq in tasks[shard].corpus.train_sequences(shard, shards, 0) for t in seq]
        expected = tokens(mine)
        assert got == expected[: len(got)] and len(expected) - len(got) < 32
    validation = torch.cat(tasks[0].validation_batches()).reshape(-1).tolist()
    assert validation == tokens(held_out)[: len(validation)], "validation is the held-out records' sequences"
    assert all(torch.equal(x, y) for t in tasks[1:] for x, y in zip(t.validation_batches(), tasks[0].validation_batches(),
                                                                     strict=True))


def test_epochs_replay_the_shard_reshuffled(assets: dict[str, Path]) -> None:
    task = build(options(assets, data={"files": [str(assets["text"])], "text_block_chars": 256, "shuffle_buffer": 8}),
                 num_shards=2)
    one = list(task.corpus.train_sequences(0, 2, epoch=0))
    again = list(task.corpus.train_sequences(0, 2, epoch=0))
    two = list(task.corpus.train_sequences(0, 2, epoch=1))
    assert one == again and sorted(one) == sorted(two) and one != two
    batches = task.train_batches()
    assert len([next(batches) for _ in range(len(one) // 4 + 3)]) == len(one) // 4 + 3  # endless


def test_lora_trains_only_the_adapters_and_the_state_leaves_the_base_out(assets: dict[str, Path]) -> None:
    task = build(options(assets, config=None, model=str(assets["model"]), tokenizer=None,
                         lora={"r": 2, "target_modules": ["q_proj", "v_proj"]}))
    local = LocalModel(TrainingConfig(enabled=True), task, error_feedback=True)
    adapters = 2 * 2 * (2 * 32 + 2 * 32)  # layers x modules x (A: r x 32, B: 32 x r)
    assert local.numel == adapters
    assert local.total_numel > 50 * adapters
    names = [name for name in local.template() if name.startswith("model/")]
    assert names and all("lora_" in name for name in names), names
    before = {k: v.clone() for k, v in task.model.state_dict().items()}
    batch = next(task.train_batches())
    local.forward_backward(batch)
    assert local.inner_step(4) is None
    changed = [k for k, v in task.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and all("lora_" in k for k in changed)


def test_gradient_checkpointing_gives_the_same_gradients(assets: dict[str, Path]) -> None:
    plain, checkpointed = build(options(assets)), build(options(assets, gradient_checkpointing=True))
    batch = next(plain.train_batches())
    grads = []
    for task in (plain, checkpointed):
        task.model.train()
        task.loss(task.model, batch).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in task.model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5)
    assert checkpointed.fingerprint == plain.fingerprint  # how gradients are computed, not which model


def field_of(error: pytest.ExceptionInfo[ConfigError]) -> str:
    return str(error.value.context.get("field"))


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (lambda a, t: {"config": None, "model": str(t / "no-such-dir"), "tokenizer": None},
         "training.task.options.model", "does not exist"),
        (lambda a, t: {"data": {"files": [str(t / "missing.txt")]}}, "training.task.options.data.files",
         "missing.txt does not exist"),
        (lambda a, t: {"data": {"files": [str(t / "nothing*.txt")]}}, "training.task.options.data.files",
         "matches no file"),
        (lambda a, t: {"data": {"files": [str(write_text(t / "empty.txt", []))]}},
         "training.task.options.data.files", "empty.txt is empty"),
        (lambda a, t: {"data": {"files": [str(a["jsonl"]), str(_malformed(t))]}},
         "training.task.options.data.files", "bad.jsonl: not readable as json"),
        (lambda a, t: {"data": {"files": [str(a["jsonl"])], "field": "content"}}, "training.task.options.data.field",
         "c.jsonl: record 1 has no field 'content'"),
        (lambda a, t: {"seq_len": 200}, "training.task.options.seq_len", "max_position_embeddings (128)"),
        (lambda a, t: {"config": {**TINY_LLAMA, "vocab_size": 100}}, "training.task.options.tokenizer",
         "more than the model's 100 embeddings"),
        (lambda a, t: {"data": {"files": [str(write_text(t / "small.txt", sentences(60)))],
                                "text_block_chars": 64, "val_every": 4}}, "training.task.num_shards",
         "fewer than one batch"),
        (lambda a, t: {"data": {"files": [str(write_text(t / "tiny.txt", sentences(10)))]}},
         "training.task.options.val_batches", "for validation (every 50th record)"),
        (lambda a, t: {"lora": {"target_modules": ["nope_proj"]}}, "training.task.options.lora.target_modules",
         "nope_proj"),
    ],
    ids=["model-dir", "file-missing", "glob-empty", "file-empty", "json-malformed", "json-field", "seq-len",
         "vocab", "too-small-for-shards", "too-small-for-validation", "lora-targets"],
)
def test_bad_input_is_one_line_naming_the_option_or_file(
    assets: dict[str, Path], tmp_path: Path, change: Any, field: str, words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        build(options(assets, **change(assets, tmp_path)), num_shards=16)
    message = str(info.value)
    assert field_of(info) == field, message
    assert words in message and "\n" not in message, message


def _malformed(directory: Path) -> Path:
    path = directory / "bad.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    return path


def test_bf16_autocast_trains_the_hf_model_and_keeps_fp32_weights(assets: dict[str, Path]) -> None:
    task = build(options(assets))
    local = LocalModel(TrainingConfig(enabled=True, precision="bf16", device="cpu", lr=0.01), task,
                       error_feedback=False)
    before = local.validation_loss()
    batches = task.train_batches()
    for _ in range(8):
        loss, samples = local.forward_backward(next(batches))
        assert local.inner_step(samples) is None and math.isfinite(loss)
    assert all(p.dtype == torch.float32 for p in local.params)
    assert local.validation_loss() < before


def test_a_data_set_by_id_streams_its_rows(assets: dict[str, Path], tmp_path: Path) -> None:
    # datasets resolves an id that is a local directory of data files offline, as it would a Hub id online
    write_jsonl(tmp_path / "dataset" / "train.jsonl", sentences(900))
    task = build(options(assets, data={"dataset": str(tmp_path / "dataset")}), num_shards=2)
    records = [text for text, _ in task.corpus.records()]
    assert records == sentences(900)
    assert next(task.train_batches()).shape == (4, 32)
    with pytest.raises(ConfigError, match="data.dataset '/no/such/dataset' could not be read") as info:
        build(options(assets, data={"dataset": "/no/such/dataset"}))
    assert field_of(info) == "training.task.options.data.dataset"


def test_text_that_is_not_utf8_is_named_or_read_with_replacement_characters(
    assets: dict[str, Path], tmp_path: Path
) -> None:
    latin = tmp_path / "latin.txt"
    lines = sentences(600)
    latin.write_bytes("".join(line + "\n" for line in lines[:3]).encode() + "caf\xe9\n".encode("latin-1")
                      + "".join(line + "\n" for line in lines[3:]).encode())
    data = {"files": [str(latin)], "text_block_chars": 256}
    with pytest.raises(ConfigError) as info:
        build(options(assets, data=data))
    message = str(info.value)
    assert field_of(info) == "training.task.options.data.files", message
    assert "latin.txt: not readable as text" in message and "encoding_errors: replace" in message, message
    task = build(options(assets, data={**data, "encoding_errors": "replace"}))
    assert next(task.train_batches()).shape == (4, 32)
