"""Options of the ``hf`` task (``training.task.options``): which model, tokenizer and data, and LoRA."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["DataOptions", "HFOptions", "LoraOptions"]

STDLIB = "{stdlib}"


class LoraOptions(BaseModel):
    """LoRA adapters (``peft``): only their parameters train, cross the wire, and are checkpointed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    r: int = Field(default=8, ge=1, le=4096, description="Rank of each adapter.")
    alpha: int = Field(default=16, ge=1, description="Scale numerator: adapters are scaled by alpha / r.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "v_proj"],
        description="Names of the modules that get adapters (as peft matches them), or 'all-linear'.",
    )


class DataOptions(BaseModel):
    """Where the text comes from: local files, or a Hub data set where the machine has a network."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    files: list[str] = Field(
        default_factory=list,
        description="Local files or glob patterns (`**` recurses), read in the order given, each glob sorted; a "
        "pattern may start with "
        f"{STDLIB}, the directory of this Python's standard library (text every machine has).",
    )
    format: Literal["auto", "text", "json", "parquet"] = Field(
        default="auto",
        description="'text': plain text; 'json': JSON lines, one record each; 'parquet'. 'auto': by extension "
        "(.jsonl/.json, .parquet, anything else text).",
    )
    encoding_errors: Literal["strict", "replace"] = Field(
        default="strict",
        description="Plain text is read as UTF-8. 'strict': a file that is not stops training with an error "
        "naming it; 'replace': its undecodable bytes become U+FFFD and reading goes on.",
    )
    field: str = Field(default="text", min_length=1, description="The record field holding the text (json, "
                       "parquet, Hub data sets).")
    dataset: str | None = Field(default=None, description="A Hub data set id instead of files.")
    dataset_config: str | None = Field(default=None, description="The Hub data set's configuration name.")
    split: str = Field(default="train", description="The Hub data set's split.")
    revision: str | None = Field(default=None, description="The Hub data set's revision (branch, tag, commit).")
    text_block_chars: int = Field(
        default=4096, ge=64, le=2**20,
        description="Plain text is cut into blocks of whole lines of about this many characters; blocks are what "
        "is dealt to the shards, so a shard reads runs of consecutive lines.",
    )
    val_every: int = Field(
        default=50, ge=1, le=2**20,
        description="Every val_every-th record from the start goes to the validation set until it holds "
        "val_batches x batch_size sequences (1: the first records), so it samples the corpus rather than its "
        "first file; those records are never trained on.",
    )
    shuffle_buffer: int = Field(
        default=256, ge=1, le=2**20,
        description="Packed sequences held for shuffling, per peer (1: in order); memory is this times seq_len.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataOptions:
        if bool(self.files) == (self.dataset is not None):
            raise ValueError("set exactly one of data.files (local files) and data.dataset (a Hub data set id)")
        return self


class HFOptions(BaseModel):
    """Options of the ``hf`` task: a ``transformers`` causal LM trained on text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(
        default=None,
        description="A directory `save_pretrained` wrote, or a Hub model id: the weights every peer starts from.",
    )
    revision: str | None = Field(default=None, description="The Hub model's revision (branch, tag or commit).")
    config: dict[str, Any] | None = Field(
        default=None,
        description="Instead of model: a transformers config mapping with its model_type (e.g. {model_type: "
        "llama, hidden_size: 128, ...}) to pretrain from scratch, initialized from training.task.seed alone.",
    )
    tokenizer: str | None = Field(
        default=None, description="Tokenizer directory or Hub id; default: the model's (required with config)."
    )
    tokenizer_revision: str | None = Field(default=None, description="The Hub tokenizer's revision.")
    data: DataOptions = Field(description="The training text.")
    seq_len: int = Field(default=256, ge=2, le=2**20, description="Tokens per packed sequence.")
    batch_size: int = Field(default=8, ge=1, description="Sequences per micro-batch.")
    val_batches: int = Field(
        default=4, ge=1, description="Held-out batches (data.val_every says which records), never trained on."
    )
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute activations in the backward pass: less memory, more compute."
    )
    lora: LoraOptions | None = Field(
        default=None, description="Fine-tune LoRA adapters instead of every weight (null: full training)."
    )

    @model_validator(mode="after")
    def _one_model(self) -> HFOptions:
        if (self.model is None) == (self.config is None):
            raise ValueError("set exactly one of model (a directory or Hub id) and config (a transformers config "
                             "mapping, to pretrain from scratch)")
        if self.config is not None:
            if not isinstance(self.config.get("model_type"), str):
                raise ValueError("config needs a model_type (e.g. llama)")
            if self.tokenizer is None:
                raise ValueError("a model built from config has no tokenizer of its own: set tokenizer")
        if self.revision is not None and self.model is None:
            raise ValueError("revision applies to a Hub model: set model or drop revision")
        return self
