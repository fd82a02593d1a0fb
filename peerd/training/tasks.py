"""Training workloads: what a peer trains, on which data, and how its loss is computed.

A :class:`Task` bundles a model with the peer's data shard and the loss. :func:`build_task` makes one from a
:class:`~peerd.config.TaskConfig`; every peer of a swarm builds it from the same config, so all start from
identical parameters (the model is initialized from ``seed`` alone) and agree on :attr:`Task.fingerprint`,
while :func:`shard_for_peer` gives each peer its own slice of the data.

Built-in tasks: ``synthetic`` (teacher-student linear regression with a known optimum,
:mod:`peerd.training.synthetic`) and ``lm`` (byte-level transformer on the standard library's source,
:mod:`peerd.training.lm`).

Custom tasks: ``name: "package.module:function"`` imports ``package.module`` and calls
``function(options, seed, shard_index, num_shards)`` positionally, which must return a :class:`Task`. It gets
``options`` as the raw mapping from the config and should reject keys it does not know by raising
:class:`~peerd.errors.ConfigError`. The same config must yield the same initial parameters on every peer, so
seed the model (and the held-out data) from ``seed`` only and the training data from ``seed`` and
``shard_index``. A tiny example, used with ``name: "mytasks:line"``::

    import torch
    from peerd.errors import ConfigError
    from peerd.training import Task, seeded_module

    class Line(Task):
        def __init__(self, seed: int, shard_index: int) -> None:
            model = seeded_module(seed, lambda: torch.nn.Linear(1, 1))
            super().__init__(model=model, batch_size=8)
            self.shard_seed = seed * 1000 + shard_index

        def train_batches(self):
            g = torch.Generator().manual_seed(self.shard_seed)
            while True:
                x = torch.randn(self.batch_size, 1, generator=g)
                yield x, 3 * x + 1

        def loss(self, model, batch):
            x, y = batch
            return torch.nn.functional.mse_loss(model(x), y)

        def validation_batches(self):
            x = torch.linspace(-1, 1, 16).unsqueeze(1)
            return [(x, 3 * x + 1)]

    def line(options: dict, seed: int, shard_index: int, num_shards: int) -> Task:
        if options:
            raise ConfigError(f"unknown option {next(iter(options))!r}", field="training.task.options")
        return Line(seed, shard_index)

Exceptions other than :class:`~peerd.errors.ConfigError` raised by a custom function propagate unchanged:
they are bugs in that code, and their traceback is what its author needs.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import torch
from pydantic import BaseModel, ValidationError

from peerd.config import TaskConfig
from peerd.errors import ConfigError
from peerd.training.device import to_device

if TYPE_CHECKING:
    from peerd.experts import ExpertClient

__all__ = [
    "BUILTIN_TASKS",
    "Batch",
    "Task",
    "TaskRuntime",
    "build_task",
    "derive_seed",
    "parse_options",
    "seeded_module",
    "shard_for_peer",
]

Batch: TypeAlias = Any
BUILTIN_TASKS = ("lm", "synthetic")
NAME_FIELD = "training.task.name"
OPTIONS_FIELD = "training.task.options"
# 64 bits: enough that two different configs never collide by accident, short enough to show in a status line.
FINGERPRINT_HEX_CHARS = 16

_Options = TypeVar("_Options", bound=BaseModel)
_Module = TypeVar("_Module", bound=torch.nn.Module)


class Task(ABC):
    """A model, this peer's training data and the loss; see the module docstring for custom tasks.

    ``fingerprint`` is set by :func:`build_task`: it hashes everything that must match across the swarm
    (task name, options after defaults, seed, parameter names, shapes and dtypes) but not the shard.
    ``optimum`` holds the known optimal parameters, keyed like ``model.state_dict()``, when there are any.
    """

    def __init__(
        self, model: torch.nn.Module, batch_size: int, optimum: dict[str, torch.Tensor] | None = None
    ) -> None:
        self.model = model
        self.batch_size = batch_size
        self.optimum = optimum
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


def parse_options(schema: type[_Options], options: Mapping[str, Any]) -> _Options:
    """Validates task options, turning pydantic's errors into a ConfigError naming the first bad key."""
    try:
        return schema.model_validate(dict(options))
    except ValidationError as e:
        lines: list[str] = []
        first: str | None = None
        for item in e.errors():
            field = ".".join([OPTIONS_FIELD, *(str(part) for part in item["loc"])])
            first = first or field
            message = "unknown option" if item["type"] == "extra_forbidden" else item["msg"]
            shown = "" if item["type"] in ("missing", "extra_forbidden") else f" = {item.get('input')!r}"
            lines.append(f"  {field}{shown}: {message}")
        allowed = ", ".join(schema.model_fields)
        message = "invalid task options:\n" + "\n".join(lines) + f"\n  (options of this task: {allowed})"
        raise ConfigError(message, field=first) from None


def task_fingerprint(name: str, options: Mapping[str, Any], seed: int, model: torch.nn.Module) -> str:
    architecture = [[key, list(value.shape), str(value.dtype)] for key, value in model.state_dict().items()]
    blob = json.dumps(
        {"task": name, "options": dict(options), "seed": seed, "architecture": architecture},
        sort_keys=True,
        default=repr,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:FINGERPRINT_HEX_CHARS]


def shard_for_peer(config: TaskConfig, peer_id: str) -> int:
    """``config.shard_index`` when set, else a hash of ``peer_id`` that is stable across runs and machines."""
    if config.shard_index is not None:
        return config.shard_index
    digest = hashlib.sha256(peer_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % config.num_shards


@dataclass(frozen=True)
class TaskRuntime:
    """What a running daemon lends the models it builds. ``experts``: the swarm's expert client, for models
    with remote mixture-of-experts layers (None outside a daemon: such layers then fail when called)."""

    experts: ExpertClient | None = None


def build_task(config: TaskConfig, shard_index: int, runtime: TaskRuntime | None = None) -> Task:
    """Builds the task named by ``config`` with this peer's ``shard_index`` and stamps its fingerprint."""
    if not 0 <= shard_index < config.num_shards:
        raise ConfigError(
            f"shard index {shard_index} is outside 0..{config.num_shards - 1}: set training.task.shard_index "
            "below training.task.num_shards",
            field="training.task.shard_index",
        )
    if ":" in config.name:
        task, options = _build_custom(config, shard_index), config.options
    elif config.name == "synthetic":
        from peerd.training.synthetic import build_synthetic

        task, options = build_synthetic(config.options, config.seed, shard_index)
    elif config.name == "lm":
        from peerd.training.lm import build_lm

        task, options = build_lm(config.options, config.seed, shard_index, config.num_shards, runtime)
    else:
        raise ConfigError(
            f"unknown task {config.name!r}: use one of {', '.join(BUILTIN_TASKS)} or "
            "'package.module:function'",
            field=NAME_FIELD,
        )
    task.fingerprint = task_fingerprint(config.name, options, config.seed, task.model)
    return task


def _build_custom(config: TaskConfig, shard_index: int) -> Task:
    module_name, _, function_name = config.name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"custom task {config.name!r}: module {e.name or module_name!r} not found (is it installed or on "
            "PYTHONPATH?)",
            field=NAME_FIELD,
        ) from e
    except Exception as e:
        raise ConfigError(
            f"custom task {config.name!r}: importing {module_name!r} failed: {type(e).__name__}: {e}",
            field=NAME_FIELD,
        ) from e
    function = getattr(module, function_name, None)
    if not callable(function):
        what = "has no attribute" if function is None else "has a non-callable attribute"
        raise ConfigError(
            f"custom task {config.name!r}: {module_name!r} {what} {function_name!r}", field=NAME_FIELD
        )
    task = function(dict(config.options), config.seed, shard_index, config.num_shards)
    if not isinstance(task, Task):
        raise ConfigError(
            f"custom task {config.name!r} returned {type(task).__name__}, not a peerd.training.Task",
            field=NAME_FIELD,
        )
    batch_size_ok = isinstance(task.batch_size, int) and task.batch_size >= 1
    if not isinstance(task.model, torch.nn.Module) or not batch_size_ok:
        raise ConfigError(
            f"custom task {config.name!r} returned a Task without an nn.Module model and a positive "
            "batch_size",
            field=NAME_FIELD,
        )
    return task
