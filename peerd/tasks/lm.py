"""The ``lm`` task: a small byte-level causal transformer trained on the Python standard library's source.

The corpus is on every Python install, so peers need no downloads: up to ``max_files`` ``*.py`` files under
``sysconfig.get_paths()["stdlib"]`` (tests, idlelib and site-packages skipped), evenly spaced over the sorted
list so every package is represented. ``val_files`` of them, again evenly spaced, are held out for validation;
the rest are dealt to the shards round-robin (file ``i`` goes to shard ``i % num_shards``), and a peer reads
only its own shard's files and the held-out ones. Peers on different Python versions read slightly different
files; that changes their data, never the model.

:class:`ByteTransformer` is a compact pre-LayerNorm decoder. Its feed-forward block comes from an
``ffn_factory(d_model, d_ff)``, so a mixture-of-experts variant can reuse everything else unchanged.

The MoE variant (option ``moe``, a :class:`~peerd.config.MoEConfig`) replaces the feed-forward of blocks
``moe.layers`` with a :class:`~peerd.experts.client.RemoteMoE` whose experts are served by peers; the daemon lends the
layers its expert client through :class:`~peerd.tasks.base.TaskRuntime`. The model's own parameters are
then the router's, never the experts'.
"""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from peerd.config import MoEConfig
from peerd.errors import ConfigError
from peerd.tasks.base import OPTIONS_FIELD, Task, TaskRuntime, derive_seed, parse_options, seeded_module

__all__ = ["VOCAB", "ByteTransformer", "LMOptions", "LMTask", "build_lm", "dense_ffn", "stdlib_sources"]

VOCAB = 256
SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
INIT_STD = 0.02
LMBatch = tuple[torch.Tensor, torch.Tensor]
FFNFactory = Callable[[int, int], nn.Module]


class LMOptions(BaseModel):
    """Options of the ``lm`` task (``training.task.options``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq_len: int = Field(default=128, ge=1, le=8192, description="Bytes of context per sample.")
    batch_size: int = Field(default=16, ge=1, description="Sequences per micro-batch.")
    d_model: int = Field(default=128, ge=8, description="Width of the residual stream.")
    n_layers: int = Field(default=2, ge=1, le=64, description="Transformer blocks.")
    n_heads: int = Field(default=4, ge=1, description="Attention heads; must divide d_model.")
    d_ff: int = Field(default=512, ge=1, description="Hidden width of each feed-forward block.")
    max_files: int = Field(default=300, ge=2, description="Standard-library files to use, at most.")
    val_files: int = Field(default=16, ge=1, description="Of those, files held out for validation.")
    val_batches: int = Field(default=8, ge=1, description="Fixed held-out batches in a validation pass.")
    moe: MoEConfig | None = Field(
        default=None,
        description="Make the feed-forward of blocks moe.layers a remote mixture of experts served by peers "
        "with an `experts:` section (hidden_dim = d_model); null: dense feed-forward everywhere.",
    )

    @model_validator(mode="after")
    def _check(self) -> LMOptions:
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        if self.moe is not None:
            if any(not -self.n_layers <= layer < self.n_layers for layer in self.moe.layers):
                raise ValueError(f"moe.layers {self.moe.layers} must index the {self.n_layers} blocks (negative "
                                 "counts from the last)")
            if len(set(self.moe_layers)) != len(self.moe.layers):
                raise ValueError(f"moe.layers {self.moe.layers} names a block twice")
        if self.val_files >= self.max_files:
            raise ValueError(f"val_files ({self.val_files}) must be below max_files ({self.max_files})")
        return self

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE blocks, negative ones resolved."""
        return [layer % self.n_layers for layer in self.moe.layers] if self.moe is not None else []


def _init_linear(module: nn.Linear, std: float = INIT_STD) -> None:
    nn.init.normal_(module.weight, std=std)
    if module.bias is not None:
        nn.init.zeros_(module.bias)


def dense_ffn(d_model: int, d_ff: int) -> nn.Module:
    """The default feed-forward block: Linear, GELU, Linear."""
    up, down = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
    _init_linear(up)
    _init_linear(down)
    return nn.Sequential(up, nn.GELU(), down)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, proj_std: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        _init_linear(self.qkv)
        _init_linear(self.proj, proj_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, ffn: nn.Module, proj_std: float) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, proj_std)
        self.ln_ffn = nn.LayerNorm(d_model)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        out: torch.Tensor = x + self.ffn(self.ln_ffn(x))
        return out


class ByteTransformer(nn.Module):
    """Bytes ``(batch, time)`` int64 in, next-byte logits ``(batch, time, 256)`` out."""

    def __init__(
        self,
        d_model: int,
        n_layers: int,
        n_heads: int,
        d_ff: int,
        max_len: int,
        ffn_factory: FFNFactory = dense_ffn,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.zeros(max_len, d_model))
        # GPT-2's scheme: small normal weights (so the initial loss is ~ln 256), attention output projections
        # shrunk with depth so the residual stream does not grow with the number of blocks. The feed-forward
        # blocks initialize themselves, so a factory's own scheme is kept.
        proj_std = INIT_STD / math.sqrt(2 * n_layers)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, ffn_factory(d_model, d_ff), proj_std) for _ in range(n_layers)
        )
        self.ln_out = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)
        nn.init.normal_(self.embed.weight, std=INIT_STD)
        nn.init.normal_(self.pos, std=INIT_STD / 2)
        _init_linear(self.head)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_out(x))
        return logits


def stdlib_sources(max_files: int) -> list[Path]:
    """Up to ``max_files`` stdlib ``*.py`` paths, evenly spaced over the sorted list of all of them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [name for name in subdirs if name not in SKIPPED_DIRS]
        found.extend(
            os.path.relpath(os.path.join(directory, name), root) for name in files if name.endswith(".py")
        )
    # Sorting relative paths makes the order independent of os.walk's and of where Python is installed.
    found.sort()
    if len(found) > max_files:
        found = [found[i * len(found) // max_files] for i in range(max_files)]
    return [root / name for name in found]


def _read(paths: list[Path]) -> torch.Tensor:
    data = bytearray()
    for path in paths:
        data += path.read_bytes()
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def _windows(data: torch.Tensor, count: int, length: int, generator: torch.Generator) -> LMBatch:
    starts = torch.randint(0, data.numel() - length, (count, 1), generator=generator)
    window = data[starts + torch.arange(length + 1)].long()
    return window[:, :-1], window[:, 1:]


class LMTask(Task):
    """Next-byte prediction; the loss is cross entropy in nats per byte."""

    def __init__(
        self,
        options: LMOptions,
        seed: int,
        shard_index: int,
        num_shards: int,
        ffn_factory: FFNFactory = dense_ffn,
        runtime: TaskRuntime | None = None,
    ) -> None:
        files = stdlib_sources(options.max_files)
        if len(files) <= options.val_files:
            raise ConfigError(
                f"only {len(files)} standard-library source files found under "
                f"{sysconfig.get_paths()['stdlib']}, but val_files is {options.val_files}: this Python "
                "install lacks its sources; use the synthetic task",
                field="training.task.name",
            )
        held_out = {i * len(files) // options.val_files for i in range(options.val_files)}
        train = [path for i, path in enumerate(files) if i not in held_out]
        self.train_data = _read(train[shard_index::num_shards])
        self.val_data = _read([files[i] for i in sorted(held_out)])
        if self.train_data.numel() <= options.seq_len:
            raise ConfigError(
                f"shard {shard_index} of {num_shards} holds {self.train_data.numel()} bytes, fewer than one "
                f"sample of seq_len {options.seq_len}: lower training.task.num_shards (below "
                f"{len(train)}) or raise max_files",
                field="training.task.num_shards",
            )
        if self.val_data.numel() <= options.seq_len:
            raise ConfigError(
                f"the {options.val_files} held-out files hold fewer bytes than one sample: raise val_files",
                field=f"{OPTIONS_FIELD}.val_files",
            )
        model = seeded_module(derive_seed(seed, "model"), lambda: _build_model(options, ffn_factory, runtime))
        super().__init__(model=model, batch_size=options.batch_size)
        self.options = options
        self.num_files = len(files)
        self._shard_seed = derive_seed(seed, "shard", shard_index)
        generator = torch.Generator().manual_seed(derive_seed(seed, "validation"))
        x, y = _windows(self.val_data, options.val_batches * options.batch_size, options.seq_len, generator)
        self._validation = list(zip(torch.split(x, options.batch_size), torch.split(y, options.batch_size), strict=True))

    def train_batches(self) -> Iterator[LMBatch]:
        generator = torch.Generator().manual_seed(self._shard_seed)
        while True:
            yield _windows(self.train_data, self.batch_size, self.options.seq_len, generator)

    def loss(self, model: nn.Module, batch: LMBatch) -> torch.Tensor:
        """Cross entropy; while training an MoE variant, plus ``moe.aux_loss_weight`` times the MoE layers'
        load-balancing losses (about 1 each when balanced), so the reported training loss includes them."""
        inputs, targets = batch
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        moe = self.options.moe
        if moe is not None and model.training and moe.aux_loss_weight > 0:
            from peerd.experts.client import RemoteMoE

            aux = [m.last_aux_loss for m in model.modules() if isinstance(m, RemoteMoE)]
            loss = loss + moe.aux_loss_weight * torch.stack(aux).sum()
        return loss

    def validation_batches(self) -> list[LMBatch]:
        return self._validation


def _build_model(options: LMOptions, ffn_factory: FFNFactory, runtime: TaskRuntime | None) -> ByteTransformer:
    model = ByteTransformer(
        options.d_model, options.n_layers, options.n_heads, options.d_ff, options.seq_len, ffn_factory
    )
    if options.moe is not None:
        from peerd.experts.client import RemoteMoE

        client = runtime.experts if runtime is not None else None
        for layer in options.moe_layers:
            block = model.blocks[layer]
            assert isinstance(block, Block)
            block.ffn = RemoteMoE(options.d_model, options.moe.uids_for(layer), options.moe, client,
                                  name=options.moe.prefix_for(layer).rstrip("."))
    return model


def build_lm(
    options: Mapping[str, Any], seed: int, shard_index: int, num_shards: int, runtime: TaskRuntime | None = None
) -> LMTask:
    """The ``lm`` task; its identity is its options after defaults. ``runtime`` lends the remote MoE layers of
    the ``moe`` variant their expert client."""
    parsed = parse_options(LMOptions, options)
    task = LMTask(parsed, seed, shard_index, num_shards, runtime=runtime)
    task.identity = parsed.model_dump()
    return task
