"""The collaborative trainer: accumulate -> publish progress -> group -> all-reduce -> identical step.

Runs on the daemon's event loop; every torch computation (forward/backward, codec work, optimizer step)
goes to a worker thread so the control endpoint answers while a step runs. One loop serves both modes
(:mod:`peerd.training.modes`): in sync mode a global step happens when the swarm has accumulated
``target_batch_size`` samples, and the sample-weighted mean gradient of the group is applied by every member
alike; in diloco mode a phase of inner steps ends and its pseudo-gradient is averaged. In lockstep
(:mod:`peerd.training.lockstep`) every peer contributes a fixed share to each step. Parameters and optimizer
state are averaged losslessly every ``state_averaging_every`` steps so peers that missed a round converge back.
A peer that a quorum of members is ahead of loads the state they vouch for (:mod:`peerd.training.joining`);
what it believes of the others' claims is :mod:`peerd.training.evidence`'s to say.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from peerd import threads
from peerd.averaging.allreduce import AllReducer
from peerd.averaging.group import STATE_KIND, round_key
from peerd.averaging.matchmaking import Matchmaker
from peerd.config import AveragingConfig, TrainingConfig
from peerd.errors import ConfigError, PeerdError
from peerd.swarm.node import SwarmNode
from peerd.tasks import Batch, Task
from peerd.training import lockstep
from peerd.training.checkpoint import Checkpointer
from peerd.training.diloco import DilocoMode
from peerd.training.distrust import Distrust
from peerd.training.evidence import Evidence
from peerd.training.export import artifacts_directory, export_task_state, save_artifacts
from peerd.training.health import AveragingHealth
from peerd.training.joining import Joining
from peerd.training.local import LocalModel
from peerd.training.modes import Mode, SyncMode
from peerd.training.progress import ProgressTracker, progress_pause, wait_unless_stopped
from peerd.training.report import TrainingReport
from peerd.training.rounds import RoundRunner
from peerd.training.transfer.server import StateServer
from peerd.wire import blockwise
from peerd.wire.guard import StreamGuard

logger = logging.getLogger(__name__)


class CollaborativeTrainer:
    def __init__(
        self, config: TrainingConfig, averaging: AveragingConfig, task: Task, swarm: SwarmNode, guard: StreamGuard,
        run_name: str, shard_index: int | None = None,
    ) -> None:
        """``shard_index``: the data shard ``task`` reads, published so lockstep groups can be ordered by it."""
        self.config = config
        self.task = task
        self.swarm = swarm
        self.peer_id = swarm.peer_id
        self.lockstep = lockstep.share(config, task.batch_size)
        self.local = LocalModel(config, task, error_feedback=averaging.codec.error_feedback)
        self.prefix = f"{run_name}.{task.fingerprint}"
        self.progress = ProgressTracker(swarm, run_name, task.fingerprint, config.progress_ttl, shard_index)
        sparse_codes = averaging.codec.scheme == "topk"
        self.report = TrainingReport(fingerprint=task.fingerprint, parameters=self.local.numel,
                                     model_parameters=self.local.total_numel,
                                     tokens_per_sample=task.tokens_per_sample, mode=config.mode,
                                     device=str(self.local.device), precision=config.precision,
                                     compute_threads=threads.compute_threads(), codec_kernel=blockwise.kernel(),
                                     codec_scheme=averaging.codec.scheme,
                                     codec_density=averaging.codec.density if sparse_codes else None,
                                     codec_value_bits=averaging.codec.value_bits if sparse_codes else None,
                                     # a departed peer's rounds fail until its progress record expires: no stall
                                     health=AveragingHealth(grace=2 * config.progress_ttl))
        self.reducer = AllReducer(guard, averaging, swarm.signer)
        matchmaker = Matchmaker(swarm, averaging, apart=self.reducer.absences.apart)
        self.rounds = RoundRunner(matchmaker, self.reducer, self.report, self.progress,
                                  averaging.codec, in_shard_order=self.lockstep is not None)
        directory = config.checkpoint.directory
        # what `peerd export` needs to write the model out of a checkpoint without this peer
        meta = {"task": config.task.model_dump(mode="json"), "parameters": self.local.param_names}
        self.checkpointer = Checkpointer(config.checkpoint, directory, meta) if directory is not None else None
        self.step = 0
        self.samples = 0
        self.step_lock = asyncio.Lock()
        distrust = Distrust()
        robust = averaging.aggregation != "mean"
        self.evidence = Evidence(self.peer_id, config.state_transfer.vouchers,
                                 averaging.max_weight_ratio if robust else None, distrust,
                                 lag_grace=config.progress_ttl,
                                 banned=lambda peer: self.reducer.bans.get(peer) is not None)
        self.mode: Mode = DilocoMode(self) if config.mode == "diloco" else SyncMode(self)
        transfer = config.state_transfer
        self.joining = Joining(self, guard, task.fingerprint, distrust)
        self.state_server = StateServer(guard, task.fingerprint, self.joining.serve,
                                        max_transfers=transfer.max_transfers, stall_timeout=transfer.stall_timeout)
        self._template = self.mode.template()
        self.report.transfers = lambda: {"download": self.joining.downloader.status(),
                                         "serve": self.state_server.status()}
        self.report.bans, self.report.absences = self.reducer.bans.status, self.reducer.absences.status
        self.report.claims = self.joining.status
        self._batches: Iterator[Batch] = task.train_batches()

    async def start(self) -> None:
        if self.config.resume and self.checkpointer is not None:
            state = await threads.run(self.checkpointer.resume, self._template, self.task.fingerprint)
            if state is not None:
                await threads.run(self.mode.restore, state)
                self.step = state.step
        if self.checkpointer is not None:
            artifacts = artifacts_directory(self.checkpointer.directory, self.task.fingerprint)
            await asyncio.to_thread(save_artifacts, self.task, artifacts)
        # the state every fresh peer starts from (the seed's), or a resumed one: served until a group agrees
        await self.joining.agree(self.step, await threads.run(self.mode.averaged_state))
        for server in (self.reducer, self.state_server):
            await server.start()
        await self.publish()
        await self.progress.refresh()
        if self.config.sync_state_on_join:
            await self.joining.join()
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
                    await self._finish(stop)
                    break
                if self.lockstep is None or self.samples < self.lockstep:
                    self.report.state = "training"
                    await self._micro_step()
                if self.config.sync_state_on_join and await self.joining.catch_up():
                    continue
                view = self.progress.view
                if self.lockstep is not None:
                    if self.samples >= self.lockstep:
                        self.report.state = "waiting"
                        await self.publish()  # the others may be waiting for exactly this record
                        shares = functools.partial(
                            lockstep.wait_for_shares, self.progress, self.peer_id, self.step, self.lockstep,
                            self.config.lockstep_timeout, stop, count_next_step=self.mode.ahead_ok > 0,
                            counted=self.evidence.counted)
                        if self.mode.rounds_in_background:
                            await self.mode.end_step(shares)  # the round waits for them, not the next step
                        else:
                            expected = await shares()
                            if not stop.is_set():
                                await self.mode.end_step(expected)
                    continue
                if self.mode.batch_complete(view):
                    await self.mode.end_step(expected=self.evidence.peers_near(view, self.step))
        finally:
            publisher.cancel()
            self.mode.cancel()

    async def _finish(self, stop: asyncio.Event) -> None:
        """``max_steps`` reached: the last round lands, validation and export, then idle (still serving)."""
        await self.mode.finish()
        if self.report.validation_step != self.step or self.config.mode == "diloco":
            await self.validate()  # e.g. the last step came from a state sync
        if self.config.export.directory is not None:
            await self.export(self.config.export.directory)
        self.report.state = "idle"
        self.report.stop_clock()  # utilisation covers the training, not the idle time after it
        await stop.wait()

    async def _wait_for_peers(self, stop: asyncio.Event) -> None:
        wanted = self.config.wait_for_peers
        if wanted <= 1:
            return
        self.report.state = "waiting"
        logger.info("Waiting for %d trainers before the first step (training.wait_for_peers)", wanted)
        while not stop.is_set() and len(self.progress.view.peers) < wanted:
            # the periodic publisher refreshes the view; re-check at its pace
            await wait_unless_stopped(stop, self.config.progress_period)
        if self.config.sync_state_on_join:
            await self.joining.join()

    async def _micro_step(self) -> None:
        # off the loop: a task's data pipeline may read and tokenize files to make the next batch
        batch = await asyncio.to_thread(next, self._batches)
        async with self.step_lock:  # diloco: a landing outer update must not move the weights mid-step
            started = time.monotonic()
            loss, samples, refused = await threads.run(self._compute, batch)
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
        """Forward and backward, then the mode's own part (diloco: the inner optimizer step)."""
        loss, samples = self.local.forward_backward(batch)
        return loss, samples, self.mode.after_backward(samples)

    # --- what the modes call back ------------------------------------------------------------------------------

    async def checkpoint(self) -> None:
        assert self.checkpointer is not None
        async with self.step_lock:
            state = await threads.run(self.mode.capture, self.step)
        path = await asyncio.to_thread(self.checkpointer.save, state, self.task.fingerprint)
        if path is not None:  # a failed write was logged by the checkpointer
            logger.info("Checkpoint %s", path)

    async def export(self, out: Path) -> None:
        """Writes the model as :mod:`peerd.training.export` does (diloco: the shared parameters); a failure is
        logged, and the checkpoints are still there to export from."""
        async with self.step_lock:
            state = await threads.run(self.mode.capture, self.step, True)
        try:
            await asyncio.to_thread(export_task_state, self.task, self.config.task, state, out,
                                    self.config.export.merge_lora)
        except (PeerdError, OSError) as e:
            logger.error("Export of step %d to %s failed: %s", self.step, out, e)
            return
        logger.info("Exported the model at step %d to %s", self.step, out)

    async def validate(self) -> None:
        async with self.step_lock:  # a diloco round landing meanwhile would change the weights mid-pass
            self.report.validation_loss = await threads.run(self.local.validation_loss)
        self.report.validation_step = self.step
        logger.info("step %d: validation loss %.4f", self.step, self.report.validation_loss)

    async def average_state(self, step: int) -> None:
        """Averages, losslessly, what members must agree on (the mode says what: sync mode's parameters and
        optimizer slots, diloco's shared parameters and outer momentum)."""
        if self.alone():
            await self.agreed(step)
            return
        group = await self.rounds.state_group(round_key(self.prefix, STATE_KIND, step),
                                              self.evidence.peers_near(self.progress.view, step))
        if group is None:
            return
        async with self.step_lock:
            averaged = await self.rounds.average_losslessly(group, self.mode.averaged_state())
            if averaged is not None:
                self.mode.load_averaged_state(averaged)
        if averaged is not None:  # the group's members hold these bits now (averaged is ours alone)
            await self.joining.agree(step, averaged)

    def alone(self) -> bool:
        """No other member is in view: the state this trainer has is the swarm's, as far as anyone can tell."""
        return not self.evidence.others(self.progress.view)

    async def agreed(self, step: int) -> None:
        """A round left this trainer's group on the same state (diloco's outer round), or it trains alone: the
        state it holds is what it serves (a joiner that sees nobody else loads it)."""
        async with self.step_lock:
            flat = await threads.run(self.mode.averaged_state)
        await self.joining.agree(step, flat)

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
            await wait_unless_stopped(stop, progress_pause(self.config, self.swarm.latency.median()))
