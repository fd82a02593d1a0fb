"""The Task API: what a workload gives the trainer, and the helpers every task builder uses.

A :class:`Task` bundles a model with this peer's data shard and the loss. Builders (built-in or custom, see
:mod:`peerd.tasks.registry`) make one from the config's options, seed and shard; every peer of a swarm builds
it from the same config, so all start from identical parameters and agree on :attr:`Task.fingerprint`.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import torch
from pydantic import BaseModel, ValidationError

from peerd.errors import ConfigError

if TYPE_CHECKING:
    from peerd.experts.client import ExpertClient

__all__ = [
    "OPTIONS_FIELD",
    "Batch",
    "Task",
    "TaskRuntime",
    "derive_seed",
    "parse_options",
    "seeded_module",
    "to_device",
]

Batch: TypeAlias = Any
OPTIONS_FIELD = "training.task.options"

_Options = TypeVar("_Options", bound=BaseModel)
_Module = TypeVar("_Module", bound=torch.nn.Module)


class Task(ABC):
    """A model, this peer's training data and the loss; :mod:`peerd.tasks.registry` has the builder contract.

    ``fingerprint`` is set by the registry: it hashes everything that must match across the swarm (task name,
    :attr:`identity`, seed, parameter names, shapes and dtypes) but not the shard. ``identity`` is what, beyond
    the architecture, makes two peers' models differ; a builder sets it (the options after defaults, say), and
    left as None the options from the config stand in. ``optimum`` holds the known optimal parameters, keyed
    like ``model.state_dict()``, when there are any. ``tokens_per_sample``: for language models, the tokens one
    sample trains on, so the status can show tokens per second (None: not a token task).
    """

    tokens_per_sample: int | None = None

    def __init__(
        self, model: torch.nn.Module, batch_size: int, optimum: dict[str, torch.Tensor] | None = None
    ) -> None:
        self.model = model
        self.batch_size = batch_size
        self.optimum = optimum
        self.identity: Mapping[str, Any] | None = None
        self.fingerprint = ""

    @abstractmethod
    def train_batches(self) -> Iterator[Batch]:
        """An endless stream of micro-batches from this peer's shard; every call replays the same stream."""

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The scalar mean training loss of ``batch`` under ``model``."""

    @abstractmethod
    def validation_batches(self) -> Sequence[Batch]:
        """The fixed held-out batches, identical on every peer and disjoint from all training shards."""

    def samples_in(self, batch: Batch) -> int:
        """Samples in ``batch``: the leading dimension of its first tensor."""
        first = batch[0] if isinstance(batch, (tuple, list)) else batch
        return int(first.shape[0])

    def validation_loss(self, model: torch.nn.Module) -> float:
        """Sample-weighted mean loss over :meth:`validation_batches`, in eval mode and without autograd."""
        was_training = model.training
        device = next(model.parameters()).device
        model.eval()
        total, count = 0.0, 0
        try:
            with torch.no_grad():
                for batch in self.validation_batches():
                    n = self.samples_in(batch)
                    total += float(self.loss(model, to_device(batch, device))) * n
                    count += n
        finally:
            model.train(was_training)
        return total / max(count, 1)

    def save_artifacts(self, directory: Path) -> None:
        """Writes what an export needs besides the weights (a model config, tokenizer files) into ``directory``;
        :mod:`peerd.training.export` reads them back. Most tasks need nothing."""


@dataclass(frozen=True)
class TaskRuntime:
    """What a running daemon lends the models it builds. ``experts``: the swarm's expert client, for models
    with remote mixture-of-experts layers (None outside a daemon: such layers then fail when called)."""

    experts: ExpertClient | None = None


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed for one purpose (``"model"``, ``("shard", 3)``, ...), independent of every other one."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def seeded_module(seed: int, factory: Callable[[], _Module]) -> _Module:
    """Runs ``factory`` with torch's global RNG seeded to ``seed`` and restored afterwards, so that the
    default initializers of torch.nn draw identical parameters on every peer without disturbing other users
    of that RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def parse_options(schema: type[_Options], options: Mapping[str, Any], field: str = OPTIONS_FIELD) -> _Options:
    """Validates task options, turning pydantic's errors into a ConfigError naming the first bad key."""
    try:
        return schema.model_validate(dict(options))
    except ValidationError as e:
        lines: list[str] = []
        first: str | None = None
        for item in e.errors():
            name = ".".join([field, *(str(part) for part in item["loc"])])
            first = first or name
            message = "unknown option" if item["type"] == "extra_forbidden" else item["msg"]
            shown = "" if item["type"] in ("missing", "extra_forbidden") else f" = {item.get('input')!r}"
            lines.append(f"  {name}{shown}: {message}")
        allowed = ", ".join(schema.model_fields)
        message = "invalid task options:\n" + "\n".join(lines) + f"\n  (options of this task: {allowed})"
        raise ConfigError(message, field=first) from None


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (also inside tuples, lists and dicts) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch
