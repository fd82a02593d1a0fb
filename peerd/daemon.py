"""The daemon: builds components from the config, supervises them on one uvloop loop, shuts down in reverse.

Start order: swarm (p2pd + DHT) -> trainer (if enabled) -> control endpoint -> first record -> ready line.
Stop order: announce ``leaving`` -> trainer -> control endpoint -> swarm. Each step is logged and bounded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from peerd import __version__
from peerd.config import PeerdConfig
from peerd.control.server import ControlServer
from peerd.errors import DaemonError, PeerdError
from peerd.swarm.node import SwarmNode, now
from peerd.swarm.records import PROTOCOL_VERSION, Capabilities, PeerRecord, PeerState

if TYPE_CHECKING:
    from peerd.training.trainer import CollaborativeTrainer

logger = logging.getLogger(__name__)


class Daemon:
    def __init__(self, config: PeerdConfig) -> None:
        self.config = config
        self.state = PeerState.STARTING
        self.started_at = now()
        self.stop_event = asyncio.Event()
        self.swarm: SwarmNode | None = None
        self.control: ControlServer | None = None
        self.trainer: CollaborativeTrainer | None = None
        self._trainer_task: asyncio.Task[None] | None = None
        self._trainer_stop = asyncio.Event()
        self._p2p: Any = None
        self._announce_now = asyncio.Event()

    # --- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self.swarm = await SwarmNode.create(self.config.swarm, self.config.run_name)
        logger.info("Joined swarm %r as %s", self.config.run_name, self.swarm.peer_id)
        if self.config.training.enabled:
            await self._start_trainer()
        self.control = await ControlServer.create(self.config.control, self.status)
        self.state = PeerState.TRAINING if self.trainer is not None else PeerState.IDLE
        await self.swarm.publish(self.record())
        if self.trainer is not None:
            self._trainer_task = asyncio.ensure_future(self.trainer.run(self._trainer_stop))

    async def _start_trainer(self) -> None:
        from peerd.training.tasks import build_task, shard_for_peer
        from peerd.training.trainer import CollaborativeTrainer

        assert self.swarm is not None
        task_config = self.config.training.task
        shard = shard_for_peer(task_config, self.swarm.peer_id)
        task = await asyncio.to_thread(build_task, task_config, shard)
        logger.info("Task %s (fingerprint %s), data shard %d of %d", task_config.name, task.fingerprint, shard,
                    task_config.num_shards)
        self._p2p = await self.swarm.dht.replicate_p2p()
        self.trainer = CollaborativeTrainer(
            self.config.training, self.config.averaging, task, self.swarm, self._p2p, self.config.run_name
        )
        await self.trainer.start()

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
        assert self.swarm is not None
        period = self.config.swarm.record_refresh_period
        while not self.stop_event.is_set():
            # jitter keeps a swarm started at once from refreshing in lockstep
            timeout = period * random.uniform(0.8, 1.0)
            waiters = {asyncio.ensure_future(self.stop_event.wait()), asyncio.ensure_future(self._announce_now.wait())}
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
            self._announce_now.clear()
            if self.stop_event.is_set():
                break
            if not self.swarm.alive():
                raise DaemonError("the DHT child process (hivemind, p2pd) died; stopping this peer")
            if self._trainer_task is not None and self._trainer_task.done():
                error = self._trainer_task.exception()
                if error is not None:
                    raise DaemonError(f"training stopped with an error: {error!r}") from error
            try:
                await self.swarm.publish(self.record())
            except PeerdError as e:
                logger.warning("Could not refresh our peer record: %s", e)

    async def shutdown(self) -> None:
        timeout = self.config.shutdown_timeout
        if self.swarm is not None and self.swarm.alive() and self.state is not PeerState.STARTING:
            self.state = PeerState.LEAVING
            try:
                await asyncio.wait_for(self.swarm.publish_leaving(self.record()), timeout / 3)
                logger.info("Announced leaving to the swarm")
            except (PeerdError, asyncio.TimeoutError) as e:
                logger.warning("Could not announce leaving: %s", e)
        if self._trainer_task is not None:
            self._trainer_stop.set()
            try:
                await asyncio.wait_for(self._trainer_task, timeout / 3)
            except asyncio.TimeoutError:
                self._trainer_task.cancel()
            except Exception as e:  # its error was already reported by the supervisor
                logger.debug("Trainer ended with %r", e)
            self._trainer_task = None
        if self.trainer is not None:
            await self.trainer.stop()
            logger.info("Trainer stopped")
            self.trainer = None
        if self._p2p is not None:
            await self._p2p.shutdown()
            self._p2p = None
        if self.control is not None:
            await self.control.shutdown()
            logger.info("Control endpoint stopped")
            self.control = None
        if self.swarm is not None:
            await self.swarm.shutdown()
            self.swarm = None

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
            roles=list(self.config.swarm.roles),
            state=self.state,
            maddrs=self.swarm.visible_maddrs(),
            capabilities=Capabilities(throughput=throughput),
            started_at=self.started_at,
            updated_at=max(now(), self.started_at),
        )

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
        assert self.swarm is not None
        peers: list[dict[str, Any]] = []
        error = None
        try:
            seen = await self.swarm.read_peers()
        except PeerdError as e:
            seen, error = [], str(e)
        current = now()
        for peer in seen:
            if peer.record.peer_id == self.swarm.peer_id:
                continue
            entry = peer.record.to_wire()
            entry["expires_in"] = round(peer.expires_at - current, 2)
            entry["age"] = round(current - peer.record.updated_at, 2)
            peers.append(entry)
        return {
            "peer_id": self.swarm.peer_id,
            "run_name": self.config.run_name,
            "software_version": __version__,
            "state": self.state.value,
            "maddrs": self.swarm.visible_maddrs(),
            "uptime": round(current - self.started_at, 2),
            "roles": list(self.config.swarm.roles),
            "pid": os.getpid(),
            "peers": peers,
            "dht_error": error,
            "training": self.trainer.report.as_dict() if self.trainer is not None else None,
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
