"""One way to name a task: ``training.task.name`` resolves to a builder function, built-in or custom alike.

Built-in names are short aliases of ``module:function`` paths (:data:`BUILTIN_TASKS`); any other name must be a
``package.module:function`` path itself. Either way the registry imports the module, calls
``function(options, seed, shard_index, num_shards)`` positionally (adding ``runtime=`` when the function takes a
parameter of that name: the daemon's :class:`~peerd.tasks.base.TaskRuntime`) and checks that it returned a
:class:`~peerd.tasks.base.Task`. ``options`` is the raw mapping from the config; a builder rejects keys it does
not know by raising :class:`~peerd.errors.ConfigError`. The same config must yield the same initial parameters on
every peer, so a builder seeds its model (and held-out data) from ``seed`` only and the training data from
``seed`` and ``shard_index``. ``docs/your-model.md`` has a complete custom task, run by the test suite.

Exceptions other than :class:`~peerd.errors.ConfigError` raised by a custom function propagate unchanged:
they are bugs in that code, and their traceback is what its author needs.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from peerd.config import TaskConfig
from peerd.errors import ConfigError
from peerd.tasks.base import Task, TaskRuntime

__all__ = ["BUILTIN_OPTIONS", "BUILTIN_TASKS", "EXPORTERS", "build_task", "resolve", "shard_for_peer", "task_fingerprint"]

BUILTIN_TASKS: dict[str, str] = {
    "synthetic": "peerd.tasks.synthetic:build_synthetic",
    "lm": "peerd.tasks.lm:build_lm",
    "hf": "peerd.tasks.hf:build_hf",
}
# The options model of each built-in task: the configuration reference lists its fields.
BUILTIN_OPTIONS: dict[str, str] = {
    "synthetic": "peerd.tasks.synthetic:SyntheticOptions",
    "lm": "peerd.tasks.lm:LMOptions",
    "hf": "peerd.tasks.hf.options:HFOptions",
}
# Tasks whose trained model is written in a format of its own; every other task exports its state dict as
# safetensors (peerd.training.export).
EXPORTERS: dict[str, str] = {"hf": "peerd.tasks.hf.export:export_hf"}
NAME_FIELD = "training.task.name"
# 64 bits: enough that two different configs never collide by accident, short enough to show in a status line.
FINGERPRINT_HEX_CHARS = 16


def build_task(config: TaskConfig, shard_index: int, runtime: TaskRuntime | None = None) -> Task:
    """Builds the task named by ``config`` with this peer's ``shard_index`` and stamps its fingerprint."""
    if not 0 <= shard_index < config.num_shards:
        raise ConfigError(
            f"shard index {shard_index} is outside 0..{config.num_shards - 1}: set training.task.shard_index "
            "below training.task.num_shards",
            field="training.task.shard_index",
        )
    function = resolve(BUILTIN_TASKS.get(config.name, config.name), config.name)
    takes_runtime = "runtime" in inspect.signature(function).parameters
    extra = {"runtime": runtime} if takes_runtime else {}
    task = _check_task(function(dict(config.options), config.seed, shard_index, config.num_shards, **extra),
                       config.name)
    identity = task.identity if task.identity is not None else config.options
    task.fingerprint = task_fingerprint(config.name, identity, config.seed, task.model)
    return task


def resolve(path: str, name: str) -> Callable[..., Any]:
    """The callable at ``module:function`` ``path``; ConfigError naming the task ``name`` if there is none."""
    if ":" not in path:
        raise ConfigError(
            f"unknown task {name!r}: use one of {', '.join(BUILTIN_TASKS)} or 'package.module:function'",
            field=NAME_FIELD,
        )
    module_name, _, function_name = path.partition(":")
    what = "task" if name in BUILTIN_TASKS else "custom task"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"{what} {name!r}: module {e.name or module_name!r} not found (is it installed or on PYTHONPATH?)",
            field=NAME_FIELD,
        ) from e
    except Exception as e:
        raise ConfigError(
            f"{what} {name!r}: importing {module_name!r} failed: {type(e).__name__}: {e}", field=NAME_FIELD
        ) from e
    function = getattr(module, function_name, None)
    if not callable(function):
        has = "has no attribute" if function is None else "has a non-callable attribute"
        raise ConfigError(f"{what} {name!r}: {module_name!r} {has} {function_name!r}", field=NAME_FIELD)
    return function  # type: ignore[no-any-return]


def _check_task(task: object, name: str) -> Task:
    if not isinstance(task, Task):
        raise ConfigError(f"task {name!r} returned {type(task).__name__}, not a peerd.tasks.Task", field=NAME_FIELD)
    batch_size_ok = isinstance(task.batch_size, int) and task.batch_size >= 1
    if not isinstance(task.model, torch.nn.Module) or not batch_size_ok:
        raise ConfigError(
            f"task {name!r} returned a Task without an nn.Module model and a positive batch_size", field=NAME_FIELD
        )
    return task


def task_fingerprint(name: str, identity: Mapping[str, Any], seed: int, model: torch.nn.Module) -> str:
    architecture = [[key, list(value.shape), str(value.dtype)] for key, value in model.state_dict().items()]
    blob = json.dumps(
        {"task": name, "options": dict(identity), "seed": seed, "architecture": architecture},
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
