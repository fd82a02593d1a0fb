"""The daemon's start steps beyond the swarm (path checks, expert server, expert client, task and trainer) and the
stack that undoes every start step in reverse.

Each step registers its undo on the :class:`StopStack` as soon as what it started runs, so a start-up that fails
half-way stops exactly what it started. The experts, tasks and training packages are imported by the steps that
start them, so a light peer (no training, no experts) never loads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from peerd.config import PeerdConfig, TrainingConfig
from peerd.swarm.node import SwarmNode
from peerd.wire.guard import StreamGuard

if TYPE_CHECKING:
    from peerd.experts import ExpertClient, ExpertServer
    from peerd.training.trainer import CollaborativeTrainer

__all__ = ["StopStack", "check_paths", "start_expert_server", "start_trainer"]

logger = logging.getLogger(__name__)


class StopStack:
    """The undo of every start step; :meth:`aclose` runs them last-registered first, each bounded and logged, and
    one that fails or times out does not keep the components started before it from stopping."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout  # each step's bound unless it names its own
        self._stack = contextlib.AsyncExitStack()

    def push(self, name: str, stop: Callable[[], Awaitable[None]], timeout: float | None = None) -> None:
        bound = self.timeout if timeout is None else timeout

        async def step() -> None:
            try:
                await asyncio.wait_for(stop(), bound)
                logger.info("Stopped the %s", name)
            except TimeoutError:
                logger.warning("Stopping the %s took longer than %.1fs; going on", name, bound)
            except Exception as e:  # noqa: BLE001 (shutdown goes on whatever one component does)
                logger.warning("Stopping the %s failed: %r", name, e)

        self._stack.push_async_callback(step)

    async def aclose(self) -> None:
        await self._stack.aclose()


async def check_paths(config: TrainingConfig) -> None:
    """Refuses paths this peer will write to later before anything starts: a checkpoint directory found
    unwritable at the first checkpoint would cost the training done until then."""
    if not config.enabled:
        return
    if config.checkpoint.directory is not None:
        from peerd.training.checkpoint import check_directory

        await asyncio.to_thread(check_directory, config.checkpoint.directory)
    if config.export.directory is not None:
        from peerd.training.export import check_export_directory

        await asyncio.to_thread(check_export_directory, config.export.directory, "training.export.directory")


async def start_expert_server(config: PeerdConfig, swarm: SwarmNode, guard: StreamGuard,
                              stops: StopStack) -> ExpertServer:
    """Builds, serves and announces the experts of ``config.experts`` (which must be set)."""
    from peerd.experts import ExpertServer

    assert config.experts is not None
    server = await ExpertServer.create(config.experts, swarm, guard, config.run_name)
    stops.push("expert server", server.stop)
    return server


async def start_trainer(config: PeerdConfig, swarm: SwarmNode, guard: StreamGuard, experts: ExpertServer | None,
                        stops: StopStack) -> tuple[CollaborativeTrainer, ExpertClient]:
    """Builds the task of this peer's data shard and starts its trainer (the training loop is the daemon's)."""
    from peerd import threads
    from peerd.experts import ExpertClient
    from peerd.tasks import TaskRuntime, build_task, shard_for_peer
    from peerd.training.trainer import CollaborativeTrainer

    task_config = config.training.task
    shard = shard_for_peer(task_config, swarm.peer_id)
    # remote MoE layers of the task call experts through this; it reads the DHT only once a layer is built
    client = ExpertClient(swarm, guard, config.run_name)
    stops.push("expert client", client.close)
    if experts is not None:  # this peer serves experts too: its model calls them in-process
        client.attach_local(experts)
    task = await threads.run(build_task, task_config, shard, TaskRuntime(experts=client))
    logger.info("Task %s (fingerprint %s), data shard %d of %d", task_config.name, task.fingerprint, shard,
                task_config.num_shards)
    trainer = CollaborativeTrainer(config.training, config.averaging, task, swarm, guard, config.run_name,
                                   shard_index=shard)
    await trainer.start()
    stops.push("trainer", trainer.stop)
    return trainer, client
