"""The daemon: builds components from the config, supervises them on one uvloop loop, shuts down in reverse.

Start order: path checks -> swarm (p2pd + DHT) -> expert server (if ``experts`` is set) -> trainer (if
enabled) -> control endpoint -> training loop -> first record -> ready line. Each start step registers its
undo (``startup.py`` holds the steps beyond the swarm and the stack of undos); stopping runs them in reverse:
announce ``leaving`` -> training loop -> control endpoint -> trainer -> expert server -> swarm.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from hivemind.p2p import P2P, P2PDaemonError

from peerd.config import PeerdConfig
from peerd.control.server import ControlServer
from peerd.control.terminal import TerminalProgress
from peerd.errors import DaemonError, PeerdError
from peerd.startup import StopStack, check_paths, start_expert_server, start_trainer
from peerd.status import peer_record, ready_line, status_document
from peerd.swarm.clock import record_lifetimes, ttl_margin_problems
from peerd.swarm.node import SwarmNode, now
from peerd.swarm.presence import Presence
from peerd.swarm.records import PeerRecord, PeerState
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
        self._stops = StopStack(config.shutdown_timeout)

    # --- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the components in order; each registers how to stop it, so :meth:`shutdown` undoes exactly
        what was started, in reverse order, also after a failure half-way through start-up."""
        self.membership = membership_from_config(self.config.swarm)
        await check_paths(self.config.training)
        if self.membership.open:
            logger.warning("Open swarm: any peer that learns an address of this swarm can join its averaging, "
                           "call its experts and download its training state (set swarm.secret_path: docs/security.md, "
                           "'Private swarms')")
        else:
            logger.info("Membership: %s; only members are served", self.membership.describe())
        for problem in ttl_margin_problems(self.config):
            logger.warning("%s", problem)
        config = self.config
        lifetimes = record_lifetimes(config.run_name, config.swarm, config.averaging, config.training, config.experts)
        self.swarm = await SwarmNode.create(config.swarm, config.run_name, self.membership,
                                            in_process=config.dht_in_process, lifetimes=lifetimes)
        self._stops.push("swarm", self.swarm.shutdown)
        logger.info("Joined swarm %r as %s", self.config.run_name, self.swarm.peer_id)
        self.presence = Presence(self.swarm, self.config.swarm, self.record)
        await self._refresh_reachability()
        if self.config.experts is not None:
            self.experts = await start_expert_server(self.config, self.swarm, await self._stream_guard(), self._stops)
        if self.config.training.enabled:
            self.trainer, self.expert_client = await start_trainer(self.config, self.swarm, await self._stream_guard(),
                                                                   self.experts, self._stops)
        # after the components it reports on: once it answers, its status has every section
        self.control = await ControlServer.create(self.config.control, self.status, self.history)
        self._stops.push("control endpoint", self.control.shutdown)
        self.state = PeerState.TRAINING if self.trainer is not None else PeerState.IDLE
        if self.trainer is not None:
            self._trainer_task = asyncio.ensure_future(self.trainer.run(self._trainer_stop))
            self._stops.push("training loop", self._stop_training_loop, self.config.shutdown_timeout / 3)
            self._progress = TerminalProgress.start(self.config.logging, self.training_snapshot)
            self._stops.push("progress display", self._progress.stop)
        await self.presence.publish()
        # registered last so it runs first: the swarm hears we leave before anything stops serving it
        self._stops.push("leaving announcement", self._announce_leaving, self.config.shutdown_timeout / 3)

    async def _p2p_handle(self) -> P2P:
        """hivemind's P2P handle to the DHT's p2pd, opened once."""
        assert self.swarm is not None
        if self._p2p is None:
            self._p2p = await self.swarm.dht.replicate_p2p()
            self._stops.push("P2P handle", self._p2p.shutdown)
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
            print(json.dumps(ready_line(self)), file=ready_stream, flush=True)
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

    # --- views (assembled by status.py) ---------------------------------------------------------------------

    def record(self) -> PeerRecord:
        """This peer's record as published now; the state follows the trainer's (training or averaging)."""
        if self.trainer is not None and self.state is not PeerState.LEAVING:
            self.state = PeerState.AVERAGING if self.trainer.report.state == "averaging" else PeerState.TRAINING
        return peer_record(self)

    def training_snapshot(self) -> dict[str, Any] | None:
        return self.trainer.report.as_dict() if self.trainer is not None else None

    def history(self, points: int) -> dict[str, Any] | None:
        return self.trainer.report.history(points) if self.trainer is not None else None

    async def status(self) -> dict[str, Any]:
        return await status_document(self)


def run_daemon(config: PeerdConfig, ready_stream: TextIO = sys.stdout) -> int:
    """Runs a daemon on a fresh uvloop loop until SIGINT/SIGTERM; returns the process exit code."""
    import uvloop

    if config.training.enabled:  # before anything runs torch: the model's ops get the cores (peerd/threads.py)
        from peerd import threads

        threads.configure()

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
