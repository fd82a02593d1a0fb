"""The collaborative trainer: accumulate -> publish progress -> group -> all-reduce -> identical step.

Runs on the daemon's event loop; every torch computation (forward/backward, codec work, optimizer step)
goes to a worker thread so the control endpoint answers while a step runs. One optimizer step happens
per global step, when the swarm has accumulated ``target_batch_size`` samples (in lockstep mode, when
every peer at the step has its ``samples_per_step``: :mod:`peerd.training.lockstep`); the gradient applied
is the sample-weighted mean over the group, so every member applies the same update. Parameters and
optimizer state are averaged losslessly every ``state_averaging_every`` steps so peers that missed a round
converge back. A peer that finds the swarm ahead of it downloads the current state instead of training on
stale parameters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from peerd.averaging.allreduce import AllReducer
from peerd.averaging.group import Group
from peerd.averaging.matchmaking import Matchmaker
from peerd.config import AveragingConfig, TrainingConfig
from peerd.errors import ConfigError, GroupFailed, PeerdError, StateError
from peerd.swarm.node import SwarmNode
from peerd.tasks import Batch, Task
from peerd.training import lockstep, snapshot
from peerd.training.checkpoint import Checkpointer
from peerd.training.download import StateDownloader
from peerd.training.export import artifacts_directory, export_task_state, save_artifacts
from peerd.training.health import AveragingHealth
from peerd.training.local import LocalModel
from peerd.training.outer import OuterState
from peerd.training.phases import OuterRounds
from peerd.training.progress import ProgressTracker, SwarmProgress, progress_pause
from peerd.training.report import TrainingReport
from peerd.training.state import TrainingState
from peerd.training.sync import StateServer
from peerd.wire.codec import all_finite
from peerd.wire.guard import StreamGuard

logger = logging.getLogger(__name__)

# Seconds between progress reads while a lockstep peer waits for the others' shares (the matchmaker polls
# the DHT at the same pace).
LOCKSTEP_POLL = 0.1
async def _wait_unless_stopped(stop: asyncio.Event, seconds: float) -> None:
    """Waits ``seconds``, or less if ``stop`` is set meanwhile: a polling pace that never delays shutdown."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


class CollaborativeTrainer:
    def __init__(
        self, config: TrainingConfig, averaging: AveragingConfig, task: Task, swarm: SwarmNode, guard: StreamGuard,
        run_name: str, shard_index: int | None = None,
    ) -> None:
        """``shard_index``: the data shard ``task`` reads, published so lockstep groups can be ordered by it."""
        self.config = config
        self.lockstep = config.samples_per_step
        if config.mode == "diloco" and config.diloco.phase_end == "lockstep":
            self.lockstep = config.diloco.inner_steps * task.batch_size  # each peer's exact share of a phase
        if self.lockstep is not None:
            lockstep.micro_batches_per_step(self.lockstep, task.batch_size)
        self.task = task
        self.swarm = swarm
        self.guard = guard
        self.local = LocalModel(config, task, error_feedback=averaging.codec.error_feedback)
        # diloco: the shared parameters and outer optimizer, and the phases' outer rounds
        self.outer = OuterState(config.diloco, self.local) if config.mode == "diloco" else None
        self.rounds = OuterRounds(self, self.outer) if self.outer is not None else None
        # diloco: a peer one phase ahead has just ended the phase we are in; only further ahead means behind
        self._ahead_ok = 1 if self.outer is not None else 0
        self.prefix = f"{run_name}.{task.fingerprint}"
        self.progress = ProgressTracker(swarm, run_name, task.fingerprint, config.progress_ttl, shard_index)
        self.matchmaker = Matchmaker(swarm, averaging)
        self.reducer = AllReducer(guard, averaging)
        self.lossless = averaging.codec.model_copy(update={"lossless": True, "error_feedback": False})
        transfer = config.state_transfer
        self.state_server = StateServer(guard, task.fingerprint, self._serve_state,
                                        max_transfers=transfer.max_transfers, stall_timeout=transfer.stall_timeout)
        directory = config.checkpoint.directory
        # what `peerd export` needs to write the model out of a checkpoint without this peer
        meta = {"task": config.task.model_dump(mode="json"), "parameters": self.local.param_names}
        self.checkpointer = Checkpointer(config.checkpoint, directory, meta) if directory is not None else None
        self.report = TrainingReport(fingerprint=task.fingerprint, parameters=self.local.numel,
                                     model_parameters=self.local.total_numel,
                                     tokens_per_sample=task.tokens_per_sample, mode=config.mode,
                                     device=str(self.local.device), precision=config.precision,
                                     # a departed peer's rounds fail until its progress record expires: no stall
                                     health=AveragingHealth(grace=2 * config.progress_ttl))
        self._template = snapshot.template(self.local, self.outer)
        self.downloader = StateDownloader(guard, task.fingerprint, self._template, config.max_state_bytes,
                                          stall_timeout=config.state_transfer.stall_timeout)
        self.report.transfers = lambda: {"download": self.downloader.status(), "serve": self.state_server.status()}
        self.step = 0
        self.samples = 0
        self.step_lock = asyncio.Lock()
        self._batches: Iterator[Batch] = task.train_batches()

    async def start(self) -> None:
        if self.config.resume and self.checkpointer is not None:
            state = await asyncio.to_thread(self.checkpointer.resume, self._template, self.task.fingerprint)
            if state is not None:
                await asyncio.to_thread(snapshot.restore, self.local, self.outer, state)
                self.step = state.step
        if self.checkpointer is not None:
            artifacts = artifacts_directory(self.checkpointer.directory, self.task.fingerprint)
            await asyncio.to_thread(save_artifacts, self.task, artifacts)
        for server in (self.reducer, self.state_server):
            await server.start()
        await self.publish()
        await self.progress.refresh()
        if self.config.sync_state_on_join and self.progress.view.max_step > self.step:
            await self._sync_from_swarm()
        self.report.step = self.step

    async def stop(self) -> None:
        for server in (self.state_server, self.reducer):
            try:
                await server.stop()
            except Exception as e:  # noqa: BLE001 - p2pd may already be gone at shutdown: nothing to unregister
                logger.debug("Could not unregister a handler: %s", e)

    # --- the loop ---------------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        publisher = asyncio.ensure_future(self._publish_periodically(stop))
        try:
            await self._wait_for_peers(stop)
            while not stop.is_set():
                if self.config.max_steps is not None and self.step >= self.config.max_steps:
                    if self.rounds is not None:  # the last phase's round, then its result on disk
                        await self.rounds.land()
                        if self.checkpointer is not None:
                            await self.checkpoint()
                    if self.report.validation_step != self.step or self.outer is not None:
                        await self.validate()  # e.g. the last step came from a state sync
                    if self.config.export.directory is not None:
                        await self.export(self.config.export.directory)
                    self.report.state = "idle"
                    self.report.stop_clock()  # utilisation covers the training, not the idle time after it
                    await stop.wait()
                    break
                if self.lockstep is None or self.samples < self.lockstep:
                    self.report.state = "training"
                    await self._micro_step()
                view = self.progress.view
                behind = view.max_step > self.step + self._ahead_ok and self.config.sync_state_on_join
                # in lockstep a failed sync goes on to this step's round: its share is already complete
                if behind and (await self._sync_from_swarm() or self.lockstep is None):
                    continue
                if self.lockstep is not None:
                    if self.samples >= self.lockstep:
                        expected = await self._wait_in_lockstep(self.lockstep, stop)
                        if not stop.is_set():
                            await self._global_step(expected)
                    continue
                if self._batch_complete(view):
                    await self._global_step(expected=max(1, len(view.peers)))
        finally:
            publisher.cancel()
            if self.rounds is not None:
                self.rounds.cancel()

    def _batch_complete(self, view: SwarmProgress) -> bool:
        """Sync: the swarm has target_batch_size samples at this step. Diloco: the trainers at this phase have
        taken inner_steps micro-batches each on average (faster peers more, slower ones fewer: nobody waits)."""
        others = [p for peer, p in view.peers.items() if p.step == self.step and peer != self.swarm.peer_id]
        samples = self.samples + sum(p.samples for p in others)
        if self.outer is None:
            return samples >= self.config.target_batch_size
        if view.max_step > self.step:  # someone already ended this phase: end it too, so we meet in its round
            return True
        return samples >= self.config.diloco.inner_steps * self.task.batch_size * (1 + len(others))

    async def _wait_for_peers(self, stop: asyncio.Event) -> None:
        wanted = self.config.wait_for_peers
        if wanted <= 1:
            return
        self.report.state = "waiting"
        logger.info("Waiting for %d trainers before the first step (training.wait_for_peers)", wanted)
        while not stop.is_set() and len(self.progress.view.peers) < wanted:
            # the periodic publisher refreshes the view; re-check at its pace
            await _wait_unless_stopped(stop, self.config.progress_period)
        if self.progress.view.max_step > self.step and self.config.sync_state_on_join:
            await self._sync_from_swarm()

    async def _micro_step(self) -> None:
        # off the loop: a task's data pipeline may read and tokenize files to make the next batch
        batch = await asyncio.to_thread(next, self._batches)
        async with self.step_lock:  # diloco: a landing outer update must not move the weights mid-step
            started = time.monotonic()
            loss, samples, refused = await asyncio.to_thread(self._compute, batch)
            elapsed = time.monotonic() - started
        if refused is not None:
            logger.error("Step %d, inner step %d: not applied: %s", self.step, self.report.inner_steps, refused)
            self.report.steps_refused += 1
        self.samples += samples
        self.report.record_compute(elapsed)
        self.report.record_loss(loss, samples, elapsed)
        if self.lockstep is not None and self.samples > self.lockstep:
            raise ConfigError(
                f"the task yielded a micro-batch of {samples} samples, not its batch_size ({self.task.batch_size}), "
                f"so this peer's share overshot {lockstep.OPTION} ({self.lockstep}); lockstep mode needs "
                f"micro-batches of batch_size samples: unset {lockstep.OPTION} for this task",
                field=lockstep.OPTION,
            )

    def _compute(self, batch: Batch) -> tuple[float, int, str | None]:
        """Forward and backward; in diloco mode also the inner optimizer step (None or why it was refused)."""
        loss, samples = self.local.forward_backward(batch)
        if self.outer is None:
            return loss, samples, None
        refused = self.local.inner_step(samples)
        self.report.inner_steps += 1
        return loss, samples, refused

    async def _wait_in_lockstep(self, samples_per_step: int, stop: asyncio.Event) -> int:
        """Waits (bounded) until every trainer at this step, or finishing the previous one, has its share;
        returns how many trainers at this step have theirs, this one included (the expected group size)."""
        self.report.state = "waiting"
        await self.publish()  # the others may be waiting for exactly this record
        me = self.swarm.peer_id
        deadline = time.monotonic() + self.config.lockstep_timeout
        while True:
            view = await self.progress.refresh()
            missing = lockstep.waiting_for(view, me, self.step, samples_per_step)
            if not missing or stop.is_set():
                break
            if time.monotonic() > deadline:
                logger.warning(
                    "Step %d: %s did not complete %d samples within training.lockstep_timeout (%.0fs); averaging "
                    "without them", self.step, ", ".join(missing), samples_per_step, self.config.lockstep_timeout,
                )
                break
            await _wait_unless_stopped(stop, LOCKSTEP_POLL)
        ready = lockstep.ready_at(view, me, self.step, samples_per_step)
        if self.outer is not None:  # peers one phase ahead just ended this one: members move on as they register
            ready += sum(1 for peer, p in view.peers.items() if peer != me and p.step == self.step + 1)
        return ready

    async def ordered(self, group: Group) -> Group:
        """In lockstep mode, the group's members in shard order (the same ranks in every run); else as is."""
        if self.lockstep is None:
            return group
        records = self.progress.view.peers
        if not set(group.members) <= set(records):
            # a member registered after our last read; its record was stored before its registration
            records = (await self.progress.refresh()).peers
        return Group(group.round_id, lockstep.canonical_order(group.members, records))

    async def _global_step(self, expected: int) -> None:
        """``expected``: trainers currently active with our fingerprint, this one included. While others are
        active we always try to average with them (the leader waits for them up to the matchmaking window)
        rather than step alone; a solo step happens only when no one else is training or no group formed."""
        if self.rounds is not None:
            await self.rounds.end_phase(expected)
            return
        self.report.state = "averaging"
        # Others see at once that the batch is complete and join the round. Published alongside our own
        # registration rather than before it: on a slow DHT they hear of the round one request sooner.
        _, averaged = await asyncio.gather(self.publish(), self._averaged_gradients(expected))
        if averaged is None:
            return
        async with self.step_lock:
            refused = await asyncio.to_thread(self.local.apply, averaged)
            if refused is not None:
                # every member of the round got the same update and refuses it too: steps stay in agreement
                logger.error("Step %d: update not applied: %s", self.step, refused)
                self.report.steps_refused += 1
            self.step += 1
            self.samples = 0
        self.report.step = self.step
        await self.publish()
        if self.config.state_averaging_every and self.step % self.config.state_averaging_every == 0:
            await self.average_state(self.step)
        if self.step % self.config.validation_every == 0:
            await self.validate()
        if self.checkpointer is not None and self.step % self.config.checkpoint.every_steps == 0:
            await self.checkpoint()

    async def _averaged_gradients(self, expected: int) -> torch.Tensor | None:
        """This step's gradients averaged with a group, or our own if no group formed; None (and dropped) if
        they hold NaN/Inf."""
        weight = float(self.samples)
        local = await asyncio.to_thread(self.local.flat_mean_grad, weight)
        if not all_finite([local]):
            logger.error("Step %d: local gradients hold NaN/Inf; dropping them instead of sharing them "
                         "(lower training.lr?)", self.step)
            self.local.drop_gradients()
            self.samples = 0
            return None
        key = f"{self.prefix}.grad.{self.step}"
        try:
            if expected < 2:
                raise GroupFailed("no other peer is at this step")
            group = await self.ordered(await self.matchmaker.form_group(key, expected))
            averaged, round_report = await self.reducer.all_reduce(
                group, local, weight, self.local.residual, average_residual=self.local.average_residual,
                out=self.local.averaged,
            )
            self.report.record_round(round_report, samples=int(weight))
            return averaged
        except PeerdError as e:  # no group, or the DHT did not answer in time: this step goes alone
            logger.log(logging.DEBUG if expected < 2 else logging.INFO, "Step %d without averaging: %s", self.step, e)
            self.report.record_solo(str(e), expected - 1)
            return local

    async def checkpoint(self) -> None:
        assert self.checkpointer is not None
        async with self.step_lock:
            state = await asyncio.to_thread(snapshot.capture, self.local, self.outer, self.step)
        path = await asyncio.to_thread(self.checkpointer.save, state, self.task.fingerprint)
        if path is not None:  # a failed write was logged by the checkpointer
            logger.info("Checkpoint %s", path)

    async def export(self, out: Path) -> None:
        """Writes the model as :mod:`peerd.training.export` does (diloco: the shared parameters); a failure is
        logged, and the checkpoints are still there to export from."""
        async with self.step_lock:
            state = await asyncio.to_thread(snapshot.capture, self.local, self.outer, self.step, True)
        try:
            await asyncio.to_thread(export_task_state, self.task, self.config.task, state, out,
                                    self.config.export.merge_lora)
        except (PeerdError, OSError) as e:
            logger.error("Export of step %d to %s failed: %s", self.step, out, e)
            return
        logger.info("Exported the model at step %d to %s", self.step, out)

    async def validate(self) -> None:
        async with self.step_lock:  # a diloco round landing meanwhile would change the weights mid-pass
            self.report.validation_loss = await asyncio.to_thread(self.local.validation_loss)
        self.report.validation_step = self.step
        logger.info("step %d: validation loss %.4f", self.step, self.report.validation_loss)

    # --- state: averaging, serving, syncing -------------------------------------------------------------------

    async def average_state(self, step: int) -> None:
        """Averages, losslessly, what members must agree on: sync mode's parameters and optimizer slots, or
        diloco's shared parameters and outer momentum (inner optimizers stay each peer's own)."""
        key = f"{self.prefix}.state.{step}"
        expected = len(self.progress.view.peers)
        if expected < 2:
            return
        try:
            group = await self.ordered(await self.matchmaker.form_group(key, expected))
            async with self.step_lock:
                flat = self.outer.flat() if self.outer is not None else self.local.flat_state()
                averaged, state_round = await self.reducer.all_reduce(group, flat, 1.0, codec_config=self.lossless)
                self.report.record_traffic("state", state_round.bytes_sent, state_round.bytes_received)
                if self.outer is not None:
                    self.outer.load_flat(averaged)
                else:
                    self.local.load_flat_state(averaged)
        except PeerdError as e:
            logger.info("State averaging at step %d skipped: %s", step, e)

    async def _serve_state(self) -> TrainingState | None:
        """A copy of the state for a joiner. In diloco mode, once the round in flight (if any) has landed: the
        joiner starts the current phase from the shared parameters that round produced."""
        for _ in range(3):  # a new round may start while we wait for the lock; it lands within its timeouts
            if self.rounds is not None and not await self.rounds.settled():
                return None
            async with self.step_lock:
                if self.rounds is None or not self.rounds.in_flight:
                    return await asyncio.to_thread(snapshot.capture, self.local, self.outer, self.step, True)
        return None

    async def _sync_from_swarm(self) -> bool:
        """Loads the state of a peer ahead of us (resuming with another when one leaves mid-transfer); False if
        none could provide it."""
        def candidates() -> list[str]:
            view = self.progress.view
            ahead = [p for peer, p in view.peers.items() if peer != self.swarm.peer_id and p.step > self.step]
            return [p.peer_id for p in sorted(ahead, key=lambda p: -p.step)]

        async def refresh() -> list[str]:
            await self.progress.refresh()
            return candidates()

        self.report.state = "syncing"
        try:
            state = await self.downloader.download(candidates(), refresh, min_step=self.step + 1)
        except StateError as e:
            logger.warning("Could not load state from any peer ahead of us; training on from step %d: %s",
                           self.step, e)
            return False
        if self.rounds is not None:  # its update belongs to a phase the donor's state already contains; it
            await self.rounds.settled()  # may be applying it right now (a thread that cannot be cancelled)
            self.rounds.cancel()
        async with self.step_lock:
            await asyncio.to_thread(snapshot.restore, self.local, self.outer, state)
            self.step, self.samples, self.report.inner_steps = state.step, 0, 0
            self.local.drop_gradients()
            self.local.forget_residuals()
        self.report.record_traffic("state_sync", 0, state.nbytes)
        self.report.step = self.step
        self.report.state_syncs += 1
        logger.info("Loaded training state at step %d from %s", state.step, ", ".join(self.downloader.bytes_from))
        await self.publish()
        return True

    # --- progress ---------------------------------------------------------------------------------------------

    async def publish(self, if_changed: bool = False) -> None:
        await self.progress.publish(self.step, self.samples, self.report.samples_per_second, if_changed)
        self.report.swarm_samples_per_second = self.progress.view.samples_per_second

    async def _publish_periodically(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.publish(if_changed=True)
            # read even while this trainer is in a round: a trainer whose batch completes at once is nearly
            # always in one, and without fresh records it never saw that the swarm was steps ahead of it
            await self.progress.refresh()
            self.report.peers_training = len(self.progress.view.peers)
            self.report.foreign_peers = dict(self.progress.view.foreign)
            await _wait_unless_stopped(stop, progress_pause(self.config, self.swarm.latency.median()))
