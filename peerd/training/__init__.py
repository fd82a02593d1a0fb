"""Training: the workloads a swarm trains (built-in ``synthetic`` and ``lm`` tasks, or a custom one)."""

from peerd.training.tasks import (
    BUILTIN_TASKS,
    Batch,
    Task,
    build_task,
    derive_seed,
    parse_options,
    seeded_module,
    shard_for_peer,
)

__all__ = [
    "BUILTIN_TASKS",
    "Batch",
    "Task",
    "build_task",
    "derive_seed",
    "parse_options",
    "seeded_module",
    "shard_for_peer",
]
