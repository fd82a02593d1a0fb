"""The ``hf`` task: a ``transformers`` causal LM trained on packed token sequences (``peerd.tasks.hf``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from peerd.errors import ConfigError
from peerd.tasks.base import Task
from peerd.tasks.hf.data import Corpus
from peerd.tasks.hf.model import Source, base_config
from peerd.tasks.hf.options import HFOptions

__all__ = ["SOURCE_FILE", "HFTask"]

# Written beside the config and tokenizer files an export needs: where the base weights come from, for merging
# LoRA adapters into them.
SOURCE_FILE = "peerd-source.json"


class HFTask(Task):
    """Batches are ``(batch_size, seq_len)`` token ids; the loss is the model's own next-token cross entropy."""

    def __init__(self, model: Any, tokenizer: Any, options: HFOptions, corpus: Corpus, source: Source | None,
                 shard_index: int, num_shards: int) -> None:
        super().__init__(model=model, batch_size=options.batch_size)
        self.tokenizer = tokenizer
        self.options = options
        self.corpus = corpus
        self.source = source
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.tokens_per_sample = options.seq_len
        validation = corpus.validation(options.val_batches * options.batch_size)
        self._validation = list(torch.split(validation, options.batch_size))
        self._check_shard_has_a_batch()

    def _check_shard_has_a_batch(self) -> None:
        sequences = 0
        for _ in self.corpus.train_sequences(self.shard_index, self.num_shards, epoch=0):
            sequences += 1
            if sequences >= self.batch_size:
                return
        raise ConfigError(
            f"data shard {self.shard_index} of {self.num_shards} holds {sequences} sequences of seq_len "
            f"{self.options.seq_len} after the validation set, fewer than one batch ({self.batch_size}): lower "
            "training.task.num_shards or seq_len, or add data", field="training.task.num_shards")

    def train_batches(self) -> Iterator[torch.Tensor]:
        epoch = 0
        while True:
            batch: list[list[int]] = []
            for sequence in self.corpus.train_sequences(self.shard_index, self.num_shards, epoch):
                batch.append(sequence)
                if len(batch) == self.batch_size:
                    yield torch.tensor(batch, dtype=torch.long)
                    batch = []
            epoch += 1  # a partial last batch waits for the next epoch's sequences, never yields short

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = model(input_ids=batch, labels=batch).loss
        return loss

    def validation_batches(self) -> list[torch.Tensor]:
        return self._validation

    def save_artifacts(self, directory: Path) -> None:
        """The config, generation config, tokenizer files and (LoRA) adapter config an export writes beside the
        weights, and where the base weights come from."""
        directory.mkdir(parents=True, exist_ok=True)
        base_config(self.model).save_pretrained(directory)
        generation = getattr(getattr(self.model, "get_base_model", lambda: self.model)(), "generation_config", None)
        if generation is not None:
            generation.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        if self.options.lora is not None:
            peft_model: Any = self.model
            peft_model.peft_config["default"].save_pretrained(directory)
        source = None if self.source is None else {"model": self.source.name, "revision": self.source.revision,
                                                   "local": self.source.local}
        (directory / SOURCE_FILE).write_text(json.dumps({"base": source, "lora": self.options.lora is not None}))
