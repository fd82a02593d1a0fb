"""diloco's phase ends and outer rounds, on behalf of the trainer: at most one round in flight.

Ending a phase takes its pseudo-gradient and moves the phase counter on at once. The round (matchmaking,
the 8-bit all-reduce of the pseudo-gradients, the outer step and its fold) then runs in the background while
the next phase computes (``training.diloco.overlap``), or before it (overlap off). A phase that ends while the
previous round is still in flight waits for it first; a round is bounded by the matchmaking and round
timeouts, so a dead peer holds nobody for longer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import torch

from peerd.errors import GroupFailed, PeerdError
from peerd.training.outer import OuterState

if TYPE_CHECKING:
    from peerd.training.trainer import CollaborativeTrainer

logger = logging.getLogger(__name__)


class OuterRounds:
    def __init__(self, trainer: CollaborativeTrainer, outer: OuterState) -> None:
        self.trainer = trainer
        self.outer = outer
        self.overlap = trainer.config.diloco.overlap
        self.pending: asyncio.Future[None] | None = None

    @property
    def in_flight(self) -> bool:
        return self.pending is not None and not self.pending.done()

    async def end_phase(self, expected: int) -> None:
        """``expected``: trainers active at this phase, this one included (the leader may close at that)."""
        t = self.trainer
        await self.land()
        every = t.config.checkpoint.every_steps
        if t.checkpointer is not None and t.step and t.step % every == 0:
            await t.checkpoint()  # between rounds: the shared parameters and the anchor agree
        t.report.state = "averaging"
        await t.publish()  # the others see at once that this peer's share is complete
        phase, weight = t.step, float(t.samples)
        async with t.step_lock:
            pseudo = await asyncio.to_thread(self.outer.end_phase)
            t.step, t.samples, t.report.inner_steps = phase + 1, 0, 0
        t.report.step = t.step
        outer_round = self._round(phase, pseudo, weight, expected)
        if self.overlap:
            self.pending = asyncio.ensure_future(outer_round)
            t.report.outer_pending = True
        else:
            await outer_round
        await t.publish()
        last = t.config.max_steps is not None and t.step >= t.config.max_steps
        if t.step % t.config.validation_every == 0 and not last:  # the last one follows its round
            await t.validate()

    async def _round(self, phase: int, pseudo: torch.Tensor, weight: float, expected: int) -> None:
        t = self.trainer
        try:
            if expected < 2:
                raise GroupFailed("no other peer is at this phase")
            key, window = f"{t.prefix}.outer.{phase}", t.config.diloco.matchmaking_window
            group = await t.ordered(await t.matchmaker.form_group(key, expected, window))
            averaged, round_report = await t.reducer.all_reduce(
                group, pseudo, weight, t.local.residual, average_residual=t.local.average_residual,
                out=self.outer.averaged,
            )
            t.report.record_round(round_report, samples=int(weight))
        except PeerdError as e:  # no group, or the DHT did not answer in time: this phase's update goes alone
            logger.log(logging.DEBUG if expected < 2 else logging.INFO, "Phase %d without averaging: %s", phase, e)
            averaged = pseudo
            t.report.record_solo(str(e), expected - 1)
        async with t.step_lock:
            refused = await asyncio.to_thread(self.outer.step, averaged)
        if refused is not None:
            logger.error("Phase %d: outer update not applied: %s", phase, refused)
            t.report.steps_refused += 1
        every = t.config.state_averaging_every
        if every and (phase + 1) % every == 0:
            await t.average_state(phase + 1)

    async def land(self) -> None:
        """Waits for the round in flight, if any, to be folded in."""
        if self.pending is None:
            return
        try:
            await self.pending
        finally:
            self.pending, self.trainer.report.outer_pending = None, False

    async def settled(self) -> bool:
        """Waits (without taking it over) for the round in flight; False if it failed."""
        if self.pending is not None and not self.pending.done():
            try:
                await asyncio.shield(self.pending)
            except Exception:  # noqa: BLE001 - the trainer reports its own round's failure when it lands it
                return False
        return True

    def cancel(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
        self.pending, self.trainer.report.outer_pending = None, False
