"""diloco's mode: inner steps alone, then phase ends and outer rounds, at most one round in flight.

Ending a phase takes its pseudo-gradient and moves the phase counter on at once. The round (matchmaking,
the all-reduce of the pseudo-gradients, the outer step) then runs in the background while the next phase
computes (``training.diloco.overlap``), which pauses only for the outer step's fold into the model; or
before it (overlap off). A phase that ends while the previous round is still in flight waits for it first; a
round is bounded by the matchmaking and round timeouts, so a dead peer holds nobody for longer.

A training state holds the shared parameters and outer momentum besides the model and the inner optimizer. A
joiner loads the shared parameters and outer momentum the group agreed on after a round and starts the phase
from theta, with its own inner optimizer; a checkpoint keeps this peer's own model, so a resumed peer keeps its
progress in the phase.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from peerd import threads
from peerd.averaging.group import round_key
from peerd.training.diloco.outer import OuterState
from peerd.training.modes import Expected, Host, Mode, counted
from peerd.training.progress import SwarmProgress
from peerd.training.state import Template, TrainingState

__all__ = ["DilocoMode"]

logger = logging.getLogger(__name__)


class DilocoMode(Mode):
    # a peer one phase ahead has just ended the phase we are in; only further ahead means behind
    ahead_ok = 1

    def __init__(self, host: Host) -> None:
        super().__init__(host)
        self.outer = OuterState(host.config.diloco, host.local)
        self.overlap = host.config.diloco.overlap
        self.pending: asyncio.Future[None] | None = None
        self.accumulate = host.config.diloco.accumulate
        self._accumulated = (0, 0)  # micro-batches and samples whose gradients await the next inner step

    def batch_complete(self, view: SwarmProgress) -> bool:
        """The trainers at this phase have taken inner_steps micro-batches each on average (faster peers more,
        slower ones fewer: nobody waits). Those that already ended it count with what they had then, so the
        others end it right after them and meet them in its round."""
        h = self.host
        believed = h.evidence.believed_step(view)
        if believed is not None and believed > h.step:  # the group ended this phase: end it too
            return True
        samples, others = h.evidence.counted_samples(view, h.step, h.samples, moved_on=True)
        per_peer = h.config.diloco.inner_steps * self.accumulate * h.local.task.batch_size
        return samples >= per_peer * (1 + others)

    def after_backward(self, samples: int) -> str | None:
        micro_batches, accumulated = self._accumulated
        self._accumulated = (micro_batches + 1, accumulated + samples)
        return self._inner_step() if micro_batches + 1 >= self.accumulate else None

    def _inner_step(self) -> str | None:
        """One inner optimizer step with the gradients accumulated since the last (None if there are none)."""
        micro_batches, samples = self._accumulated
        if not micro_batches:
            return None
        self._accumulated = (0, 0)
        self.host.report.inner_steps += 1
        return self.host.local.inner_step(samples)

    @property
    def rounds_in_background(self) -> bool:
        return self.overlap

    @property
    def in_flight(self) -> bool:
        return self.pending is not None and not self.pending.done()

    async def end_step(self, expected: Expected) -> None:
        """``expected``: trainers active at this phase, this one included (the leader may close at that). With
        overlap, a lockstep peer waits for the others' shares in the background round, not before the next
        phase: otherwise every phase would end with the whole swarm idle until its slowest peer is done."""
        h = self.host
        if not self.overlap:
            expected = await counted(expected)
        await self.land()
        every = h.config.checkpoint.every_steps
        if h.checkpointer is not None and h.step and h.step % every == 0:
            await h.checkpoint()  # between rounds: the shared parameters and the anchor agree
        h.report.state = "averaging"
        await h.publish()  # the others see at once that this peer's share is complete
        phase, weight = h.step, float(h.samples)
        async with h.step_lock:
            # a phase the swarm ended between inner steps: the gradients accumulated so far still count
            refused = await threads.run(self._inner_step)
            if refused is not None:
                logger.error("Phase %d, last inner step: not applied: %s", phase, refused)
            pseudo = await threads.run(self.outer.end_phase)
            h.step, h.samples, h.report.inner_steps = phase + 1, 0, 0
        h.report.step = h.step
        outer_round = self._round(phase, pseudo, weight, expected)
        if self.overlap:
            self.pending = asyncio.ensure_future(outer_round)
            h.report.outer_pending = True
        else:
            await outer_round
        await h.publish()
        last = h.config.max_steps is not None and h.step >= h.config.max_steps
        if h.step % h.config.validation_every == 0 and not last:  # the last one follows its round
            await h.validate()

    async def _round(self, phase: int, pseudo: torch.Tensor, weight: float, expected: Expected) -> None:
        h = self.host
        trainers = await counted(expected)
        averaged = await h.rounds.average(
            round_key(h.prefix, "outer", phase), pseudo, weight, trainers, residual=h.local.residual,
            average_residual=h.local.average_residual, out=self.outer.averaged,
            window=h.config.diloco.matchmaking_window, what=f"Phase {phase}")
        # the outer step off the lock, beside the next phase's inner steps; only its fold into the model stops them
        update = await threads.run(self.outer.prepare, averaged)
        if isinstance(update, str):
            refused: str | None = update
        else:
            async with h.step_lock:
                committed = await threads.run(self.outer.commit, update)
                # a state loaded meanwhile made the update stale: step from that state instead
                refused = None if committed else await threads.run(self.outer.step, averaged)
        if refused is not None:
            logger.error("Phase %d: outer update not applied: %s", phase, refused)
            h.report.steps_refused += 1
        elif averaged is not pseudo or h.alone():  # the group's members (or this lone one) hold this state
            await h.agreed(phase + 1)
        every = h.config.state_averaging_every
        if every and (phase + 1) % every == 0:
            await h.average_state(phase + 1)

    async def finish(self) -> None:
        """The last phase's round, then its result on disk."""
        await self.land()
        if self.host.checkpointer is not None:
            await self.host.checkpoint()

    async def land(self) -> None:
        """Waits for the round in flight, if any, to be folded in."""
        if self.pending is None:
            return
        try:
            await self.pending
        finally:
            self.pending, self.host.report.outer_pending = None, False

    async def settled(self) -> bool:
        if self.pending is not None and not self.pending.done():
            try:
                await asyncio.shield(self.pending)
            except Exception:  # noqa: BLE001 - the trainer reports its own round's failure when it lands it
                return False
        return True

    def cancel(self) -> None:
        if self.pending is not None:
            self.pending.cancel()
        self.pending, self.host.report.outer_pending = None, False

    # --- state ------------------------------------------------------------------------------------------------

    def averaged_state(self) -> torch.Tensor:
        """The shared parameters and outer momentum (inner optimizers stay each peer's own)."""
        return self.outer.flat()

    def load_averaged_state(self, flat: torch.Tensor) -> None:
        self.outer.load_flat(flat)

    def averaged_numel(self) -> int:
        return self.outer.flat_numel()

    def load_agreed(self, flat: torch.Tensor) -> None:
        """The phase starts from the group's theta: this peer's progress in its own phase is dropped."""
        self.outer.adopt(flat)

    def template(self) -> Template:
        layout = super().template()
        layout.update({name: (tuple(t.shape), t.dtype) for name, t in self.outer.named().items()})
        return layout

    def capture(self, step: int, shared: bool = False) -> TrainingState:
        tensors = self.host.local.export_state(parameters=self.outer.shared if shared else None)
        tensors.update({name: t.detach().to("cpu", copy=True).contiguous() for name, t in self.outer.named().items()})
        return TrainingState(step, tensors)

    def restore(self, state: TrainingState) -> None:
        super().restore(state)
        self.outer.load_named(state.tensors)
        self._accumulated = (0, 0)  # the caller drops the gradients: they belong to the state replaced
