"""The ``synthetic`` task: teacher-student linear regression whose optimum is known exactly.

A teacher ``y = W x + b + noise`` with ``W`` and ``b`` drawn from the seed generates the data; the student is
an ``nn.Linear`` initialized from a different stream of the same seed. Because the teacher is the minimizer of
the expected MSE, :attr:`Task.optimum` lets tests and the status page measure how far the swarm's averaged
model is from the solution, not just whether its loss falls.

Inputs are standard normal, so the expected Hessian of the MSE is ``2 I / out_dim``: plain SGD with lr 0.1
contracts the error by 0.8 per step and reaches the optimum within a few hundred steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from peerd.tasks.base import Task, derive_seed, parse_options, seeded_module

__all__ = ["SyntheticOptions", "SyntheticTask", "build_synthetic"]

SyntheticBatch = tuple[torch.Tensor, torch.Tensor]


class SyntheticOptions(BaseModel):
    """Options of the ``synthetic`` task (``training.task.options``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dim: int = Field(default=32, ge=1, le=65536, description="Input features.")
    out_dim: int = Field(default=1, ge=1, le=1024, description="Regression targets per sample.")
    batch_size: int = Field(default=32, ge=1, description="Samples per micro-batch.")
    noise: float = Field(default=0.01, ge=0, description="Standard deviation of the label noise.")
    val_size: int = Field(default=1024, ge=1, description="Samples in the held-out validation set.")


class SyntheticTask(Task):
    """Linear regression onto a fixed random teacher; this shard draws its own inputs."""

    def __init__(self, options: SyntheticOptions, seed: int, shard_index: int) -> None:
        teacher = torch.Generator().manual_seed(derive_seed(seed, "teacher"))
        # 1/sqrt(dim) keeps the targets at unit scale whatever the input width.
        weight = torch.randn(options.out_dim, options.dim, generator=teacher) / options.dim**0.5
        bias = torch.randn(options.out_dim, generator=teacher)
        model = seeded_module(
            derive_seed(seed, "model"), lambda: torch.nn.Linear(options.dim, options.out_dim)
        )
        optimum = {"weight": weight.clone(), "bias": bias.clone()}
        super().__init__(model=model, batch_size=options.batch_size, optimum=optimum)
        self.options = options
        self._weight, self._bias = weight, bias
        self._shard_seed = derive_seed(seed, "shard", shard_index)
        validation = torch.Generator().manual_seed(derive_seed(seed, "validation"))
        x, y = self._sample(options.val_size, validation)
        self._validation = list(zip(torch.split(x, options.batch_size), torch.split(y, options.batch_size), strict=True))

    def _sample(self, n: int, generator: torch.Generator) -> SyntheticBatch:
        x = torch.randn(n, self.options.dim, generator=generator)
        noise = torch.randn(n, self.options.out_dim, generator=generator) * self.options.noise
        return x, x @ self._weight.T + self._bias + noise

    def train_batches(self) -> Iterator[SyntheticBatch]:
        generator = torch.Generator().manual_seed(self._shard_seed)
        while True:
            yield self._sample(self.batch_size, generator)

    def loss(self, model: torch.nn.Module, batch: SyntheticBatch) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    def validation_batches(self) -> list[SyntheticBatch]:
        return self._validation


def build_synthetic(options: Mapping[str, Any], seed: int, shard_index: int, num_shards: int) -> SyntheticTask:
    """The ``synthetic`` task; its identity is its options after defaults."""
    parsed = parse_options(SyntheticOptions, options)
    task = SyntheticTask(parsed, seed, shard_index)
    task.identity = parsed.model_dump()
    return task
