"""Tiny Hugging Face models, tokenizers and text for the tests, all built locally: nothing comes from a hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128,
}
WORDS = ["peer", "swarm", "model", "average", "gradient", "tensor", "shard", "round", "group", "weight", "token", "loss", "step", "daemon", "record", "train", "data", "file", "batch", "export", "adapter"]


def sentences(count: int, seed: int = 0) -> list[str]:
    """``count`` lines of made-up text with some structure to learn (word pairs repeat)."""
    g = torch.Generator().manual_seed(seed)
    lines = []
    for i in range(count):
        picks = torch.randint(len(WORDS), (6,), generator=g).tolist()
        words = [WORDS[p] for p in picks]
        lines.append(f"{i % 7} {words[0]} {words[1]} {words[0]} {' '.join(words[2:])}.")
    return lines


def make_tokenizer(directory: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer trained on :func:`sentences`, saved where AutoTokenizer loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sentences(500), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>").save_pretrained(directory)
    return directory


def make_model(directory: Path, seed: int = 0, tokenizer: Path | None = None, **overrides: Any) -> Path:
    """A tiny Llama saved with save_pretrained (and the tokenizer's files beside it, if given)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    settings = {**TINY_LLAMA, **overrides}
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    if tokenizer is not None:
        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(directory)
    return directory


def write_text(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_jsonl(path: Path, lines: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: line, "id": i}) + "\n" for i, line in enumerate(lines)))
    return path


def write_parquet(path: Path, lines: list[str], field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({field: lines}), path)
    return path


def tokenizer_and_model(root: Path) -> dict[str, Path]:
    """A tokenizer and a tiny Llama saved beside it under ``root``: what every test of the hf task starts from."""
    tokenizer = make_tokenizer(root / "tokenizer")
    return {"root": root, "tokenizer": tokenizer, "model": make_model(root / "model", tokenizer=tokenizer)}
