"""The daemon: builds components from the config, supervises them on one uvloop loop, shuts down in reverse.

Start order: path checks -> swarm (p2pd + DHT) -> expert server (if ``experts`` is set) -> trainer (if
enabled) -> control endpoint -> training loop -> first record -> ready line. Each start step registers its
undo; stopping runs them in reverse: announce ``leaving`` -> training loop -> control endpoint -> trainer ->
expert server -> swarm. Each stop step is logged and bounded, and one that fails does not keep the others from
running.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TextIO

from hivemind.p2p import P2P, P2PDaemonError

from peerd import __version__
from peerd.config import PeerdConfig
from peerd.control.server import ControlServer
from peerd.control.terminal import TerminalProgress
from peerd.errors import DaemonError, PeerdError
from peerd.swarm.clock import record_lifetimes, ttl_margin_problems
from peerd.swarm.node import SwarmNode, now
from peerd.swarm.presence import Presence
from peerd.swarm.records import PROTOCOL_VERSION, Capabilities, PeerRecord, PeerState
from peerd.wire.guard import StreamGuard
from peerd.wire.membership import Membership, membership_from_config

if TYPE_CHECKING:
    from peerd.experts import ExpertClient, ExpertServer
    from peerd.training.trainer import CollaborativeTrainer

logger = logging.getLogger(__name__)


class Daemon:
    def __init__(self, config: PeerdConfig) -> None:
        self.config = config
        self.state = PeerState.STARTING
        self.started_at = now()
        self.stop_event = asyncio.Event()
        self.swarm: SwarmNode | None = None
        self.presence: Presence | None = None
        self.control: ControlServer | None = None
        self.trainer: CollaborativeTrainer | None = None
        self._trainer_task: asyncio.Task[None] | None = None
        self._trainer_stop = asyncio.Event()
        self.guard: StreamGuard | None = None
        self._p2p: P2P | None = None
        self.membership = Membership()
        self.experts: ExpertServer | None = None
        self.expert_client: ExpertClient | None = None
        self._progress: TerminalProgress | None = None
        self._stops = contextlib.AsyncExitStack()  # the undo of every start step, run in reverse

    # --- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the components in order; each registers how to stop it, so :meth:`shutdown` undoes exactly
        what was started, in reverse order, also after a failure half-way through start-up."""
        self.membership = membership_from_config(self.config.swarm)
        await self._check_paths()
        if self.membership.open:
            logger.warning("Open swarm: any peer that learns an address of this swarm can join its averaging, "
                           "call its experts and download its training state (set swarm.secret_path: README, "
                           "'Private swarms')")
        else:
            logger.info("Membership: %s; only members are served", self.membership.describe())
        for problem in ttl_margin_problems(self.config):
            logger.warning("%s", problem)
        config = self.config
        lifetimes = record_lifetimes(config.run_name, config.swarm, config.averaging, config.training, config.experts)
        self.swarm = await SwarmNode.create(config.swarm, config.run_name, self.membership,
                                            in_process=config.dht_in_process, lifetimes=lifetimes)
        self._on_stop("swarm", self.swarm.shutdown)
        logger.info("Joined swarm %r as %s", self.config.run_name, self.swarm.peer_id)
        self.presence = Presence(self.swarm, self.config.swarm, self.record)
        await self._refresh_reachability()
        if self.config.experts is not None:
            await self._start_experts()
        if self.config.training.enabled:
            await self._start_trainer()
        # after the components it reports on: once it answers, its status has every section
        self.control = await ControlServer.create(self.config.control, self.status, self.history)
        self._on_stop("control endpoint", self.control.shutdown)
        self.state = PeerState.TRAINING if self.trainer is not None else PeerState.IDLE
        if self.trainer is not None:
            self._trainer_task = asyncio.ensure_future(self.trainer.run(self._trainer_stop))
            self._on_stop("training loop", self._stop_training_loop, self.config.shutdown_timeout / 3)
            self._progress = TerminalProgress.start(self.config.logging, self.training_snapshot)
            self._on_stop("progress display", self._progress.stop)
        await self.presence.publish()
        # registered last so it runs first: the swarm hears we leave before anything stops serving it
        self._on_stop("leaving announcement", self._announce_leaving, self.config.shutdown_timeout / 3)

    async def _check_paths(self) -> None:
        """Refuses paths this peer will write to later before anything starts: a checkpoint directory found
        unwritable at the first checkpoint would cost the training done until then."""
        checkpoints = self.config.training.checkpoint.directory
        if self.config.training.enabled and checkpoints is not None:
            from peerd.training.checkpoint import check_directory

            await asyncio.to_thread(check_directory, checkpoints)

    async def _p2p_handle(self) -> P2P:
        """hivemind's P2P handle to the DHT's p2pd, opened once."""
        assert self.swarm is not None
        if self._p2p is None:
            self._p2p = await self.swarm.dht.replicate_p2p()
            self._on_stop("P2P handle", self._p2p.shutdown)
        return self._p2p

    async def _stream_guard(self) -> StreamGuard:
        """The door of every peerd stream (membership handshake, limits); shared by the expert server and the
        trainer."""
        if self.guard is None:
            self.guard = StreamGuard(await self._p2p_handle(), self.membership, self.config.swarm.streams)
        return self.guard

    async def _refresh_reachability(self) -> None:
        """Reads how this peer is reached (a relay slot, connections, the relay service) from p2pd."""
        assert self.swarm is not None
        try:
            await asyncio.wait_for(self.swarm.reach.refresh(await self._p2p_handle(), self.config.swarm.request_timeout),
                                   self.config.swarm.request_timeout * 2)
        except (TimeoutError, OSError, P2PDaemonError, ValueError) as e:
            logger.debug("Could not read reachability from p2pd: %r", e)

    async def _start_experts(self) -> None:
        from peerd.experts import ExpertServer

        config = self.config.experts
        assert self.swarm is not None and config is not None
        guard = await self._stream_guard()
        self.experts = await ExpertServer.create(config, self.swarm, guard, self.config.run_name)
        self._on_stop("expert server", self.experts.stop)

    async def _start_trainer(self) -> None:
        from peerd.experts import ExpertClient
        from peerd.training.tasks import TaskRuntime, build_task, shard_for_peer
        from peerd.training.trainer import CollaborativeTrainer

        assert self.swarm is not None
        task_config = self.config.training.task
        shard = shard_for_peer(task_config, self.swarm.peer_id)
        guard = await self._stream_guard()
        # remote MoE layers of the task call experts through this; it reads the DHT only once a layer is built
        self.expert_client = ExpertClient(self.swarm, guard, self.config.run_name)
        self._on_stop("expert client", self.expert_client.close)
        if self.experts is not None:  # this peer serves experts too: its model calls them in-process
            self.expert_client.attach_local(self.experts)
        task = await asyncio.to_thread(build_task, task_config, shard, TaskRuntime(experts=self.expert_client))
        logger.info("Task %s (fingerprint %s), data shard %d of %d", task_config.name, task.fingerprint, shard,
                    task_config.num_shards)
        self.trainer = CollaborativeTrainer(
            self.config.training, self.config.averaging, task, self.swarm, guard, self.config.run_name,
            shard_index=shard,
        )
        await self.trainer.start()
        self._on_stop("trainer", self.trainer.stop)

    def _on_stop(self, name: str, stop: Callable[[], Awaitable[None]], timeout: float | None = None) -> None:
        """Registers the undo of a start step; each runs bounded and logged, and a failure does not keep
        the components started before it from stopping."""
        bound = self.config.shutdown_timeout if timeout is None else timeout

        async def step() -> None:
            try:
                await asyncio.wait_for(stop(), bound)
                logger.info("Stopped the %s", name)
            except TimeoutError:
                logger.warning("Stopping the %s took longer than %.1fs; going on", name, bound)
            except Exception as e:  # noqa: BLE001 (shutdown goes on whatever one component does)
                logger.warning("Stopping the %s failed: %r", name, e)

        self._stops.push_async_callback(step)

    async def _announce_leaving(self) -> None:
        assert self.swarm is not None and self.presence is not None
        if self.swarm.alive():
            self.state = PeerState.LEAVING
            await self.presence.leave()

    async def _stop_training_loop(self) -> None:
        task, self._trainer_task = self._trainer_task, None
        if task is None:
            return
        self._trainer_stop.set()
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:  # the bound expired (wait_for cancels us): cancel the loop itself
            task.cancel()
            raise
        except Exception as e:  # noqa: BLE001 (its error was already reported by the supervisor)
            logger.debug("Trainer ended with %r", e)

    async def run(self, ready_stream: TextIO = sys.stdout) -> None:
        """Starts, prints the ready line, supervises until a stop signal, then shuts down."""
        try:
            await self.start()
            assert self.swarm is not None and self.control is not None  # set by start()
            print(json.dumps(self.ready_info()), file=ready_stream, flush=True)
            logger.info("Ready: control endpoint %s, reachable at %s", self.control.url,
                        " ".join(self.swarm.visible_maddrs()))
            await self._supervise()
        finally:
            await self.shutdown()

    async def _supervise(self) -> None:
        assert self.swarm is not None and self.presence is not None
        republish = self.presence.republish
        period = self.config.swarm.record_refresh_period
        while not self.stop_event.is_set():
            # jitter keeps a swarm started at once from refreshing in lockstep
            timeout = period * random.uniform(0.8, 1.0)
            waiters = {asyncio.ensure_future(self.stop_event.wait()), asyncio.ensure_future(republish.wait())}
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
            republish.clear()
            if self.stop_event.is_set():
                break
            if not self.swarm.alive():
                raise DaemonError("the DHT (hivemind's, with p2pd) stopped; stopping this peer")
            if self._trainer_task is not None and self._trainer_task.done():
                error = self._trainer_task.exception()
                if error is not None:
                    raise DaemonError(f"training stopped with an error: {error!r}") from error
            await self._refresh_reachability()
            await self.presence.refresh()

    async def shutdown(self) -> None:
        """Stops what :meth:`start` started, in reverse order: leaving announcement, progress display,
        training loop, control endpoint, trainer, expert client, expert server, P2P handle, swarm."""
        await self._stops.aclose()

    def request_stop(self) -> None:
        if not self.stop_event.is_set():
            logger.info("Stop requested; shutting down")
        self.stop_event.set()

    # --- views -----------------------------------------------------------------------------------------------

    def record(self) -> PeerRecord:
        assert self.swarm is not None
        throughput = None
        if self.trainer is not None and self.state is not PeerState.LEAVING:
            self.state = PeerState.AVERAGING if self.trainer.report.state == "averaging" else PeerState.TRAINING
            throughput = round(self.trainer.report.samples_per_second, 3)
        return PeerRecord(
            peer_id=self.swarm.peer_id,
            software_version=__version__,
            protocol_version=PROTOCOL_VERSION,
            roles=self._roles(),
            state=self.state,
            maddrs=self.swarm.visible_maddrs(),
            capabilities=Capabilities(throughput=throughput, experts=self.experts.uids if self.experts else []),
            started_at=self.started_at,
            updated_at=max(now(), self.started_at),
            peers_seen=self.presence.view.seen_count if self.presence is not None else None,
        )

    def _roles(self) -> list[str]:
        roles: list[str] = list(self.config.swarm.roles)
        if self.experts is not None and "expert_host" not in roles:
            roles.append("expert_host")
        return roles

    def experts_snapshot(self) -> dict[str, Any] | None:
        """``calls``/``errors``/``latency`` (both sides, for /metrics); ``server``: this host's experts (calls,
        tokens, latency, errors, updates); ``client``: the experts this peer's model called (latency, failures)
        and its MoE layers (fallback tokens). See ``peerd.experts.stats.status_section``."""
        if self.experts is None and self.expert_client is None:
            return None
        from peerd.experts.stats import status_section

        return status_section(self.experts, self.expert_client)

    def training_snapshot(self) -> dict[str, Any] | None:
        return self.trainer.report.as_dict() if self.trainer is not None else None

    def history(self, points: int) -> dict[str, Any] | None:
        return self.trainer.report.history(points) if self.trainer is not None else None

    def ready_info(self) -> dict[str, Any]:
        assert self.swarm is not None and self.control is not None
        return {
            "event": "ready",
            "peer_id": self.swarm.peer_id,
            "maddrs": self.swarm.visible_maddrs(),
            "control": self.control.url,
            "run_name": self.config.run_name,
            "pid": os.getpid(),
        }

    async def status(self) -> dict[str, Any]:
        assert self.swarm is not None and self.presence is not None
        peers, peers_read_age, error = await self.presence.peers()
        return {
            "peer_id": self.swarm.peer_id,
            "run_name": self.config.run_name,
            "software_version": __version__,
            "state": self.state.value,
            "maddrs": self.swarm.visible_maddrs(),
            "uptime": round(now() - self.started_at, 2),
            "roles": self._roles(),
            "pid": os.getpid(),
            "peers": peers,
            "peers_read_age": peers_read_age,  # seconds since the read of the records in `peers` began
            "dht_error": error,
            "view": self.presence.view.status(),
            # the median of this peer's recent DHT stores and reads: matchmaking windows and progress reads
            # stretch with it
            "dht_request_seconds": round(self.swarm.latency.median(), 4),
            "records_dropped": await self.swarm.dropped_records(),
            "training": self.trainer.report.as_dict() if self.trainer is not None else None,
            "experts": self.experts_snapshot(),
            "membership": self.guard.status() if self.guard is not None else {"mode": self.membership.describe()},
            "reachability": self.swarm.reach.status(),
        }


def run_daemon(config: PeerdConfig, ready_stream: TextIO = sys.stdout) -> int:
    """Runs a daemon on a fresh uvloop loop until SIGINT/SIGTERM; returns the process exit code."""
    import uvloop

    async def main() -> int:
        daemon = Daemon(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, daemon.request_stop)
        started = time.monotonic()
        try:
            await daemon.run(ready_stream)
        except PeerdError as e:
            logger.error("%s", e)
            return 1
        logger.info("Stopped cleanly after %.1fs", time.monotonic() - started)
        return 0

    return uvloop.run(main())
