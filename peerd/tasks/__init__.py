"""Workloads: what a swarm trains. The Task API (:mod:`peerd.tasks.base`), the registry that resolves built-in
and custom task names alike (:mod:`peerd.tasks.registry`), and the built-in tasks: ``synthetic``, ``lm`` and
``hf`` (a Hugging Face causal LM on your own files, :mod:`peerd.tasks.hf`)."""

from peerd.tasks.base import Batch, Task, TaskRuntime, derive_seed, parse_options, seeded_module, to_device
from peerd.tasks.registry import BUILTIN_TASKS, build_task, shard_for_peer

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
    "to_device",
]
