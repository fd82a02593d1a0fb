"""What differs between the training modes, behind one interface the trainer drives: when the swarm's batch is
complete, what a micro-step does after its backward pass, how a global step ends, what state averaging
averages, and what a training state holds. :class:`SyncMode` is here; diloco's is
:class:`peerd.training.diloco.DilocoMode`. Lockstep is not a mode of its own: it changes when a step's share
is complete (:mod:`peerd.training.lockstep`), in either mode.

A mode acts on the trainer through :class:`Host`, the part of the trainer it may use, so modes never import
the trainer.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Protocol

import torch

from peerd import threads
from peerd.averaging.group import round_key
from peerd.config import TrainingConfig
from peerd.training.checkpoint import Checkpointer
from peerd.training.evidence import Evidence
from peerd.training.local import LocalModel
from peerd.training.progress import SwarmProgress
from peerd.training.report import TrainingReport
from peerd.training.rounds import RoundRunner
from peerd.training.state import Template, TrainingState
from peerd.wire.codec import all_finite

__all__ = ["Expected", "Host", "Mode", "SyncMode", "counted"]

logger = logging.getLogger(__name__)

# The trainers expected in a step's round, this one included; in lockstep, how to wait until the others have
# their shares and count them (a mode whose rounds run in the background waits there, beside the next compute).
Expected = int | Callable[[], Awaitable[int]]


async def counted(expected: Expected) -> int:
    return expected if isinstance(expected, int) else await expected()


class Host(Protocol):
    """The trainer, as a mode sees it."""

    config: TrainingConfig
    local: LocalModel
    report: TrainingReport
    rounds: RoundRunner
    evidence: Evidence  # what of the others' progress claims this trainer believes
    checkpointer: Checkpointer | None
    prefix: str  # of every round key: run name and task fingerprint
    peer_id: str
    step: int  # the global step (diloco: the phase)
    samples: int  # this peer's samples towards it
    step_lock: asyncio.Lock  # held while the weights change

    async def publish(self, if_changed: bool = False) -> None: ...
    async def validate(self) -> None: ...
    async def checkpoint(self) -> None: ...
    async def average_state(self, step: int) -> None: ...
    async def agreed(self, step: int) -> None: ...  # a round left the group on the same state: it is served
    def alone(self) -> bool: ...  # no other member in view


class Mode(ABC):
    """``ahead_ok``: how many steps ahead another trainer may be before this one counts as behind."""

    ahead_ok = 0

    def __init__(self, host: Host) -> None:
        self.host = host

    @abstractmethod
    def batch_complete(self, view: SwarmProgress) -> bool:
        """Whether the swarm has done this step's share of work (outside lockstep)."""

    def after_backward(self, samples: int) -> str | None:
        """Runs in the worker thread after a micro-batch's backward pass; None, or why its update was refused."""
        return None

    @abstractmethod
    async def end_step(self, expected: Expected) -> None:
        """Ends the global step: average with a group (``expected`` trainers at it, this one included) or alone."""

    async def finish(self) -> None:
        """``max_steps`` is reached: whatever is in flight lands."""

    @abstractmethod
    def averaged_state(self) -> torch.Tensor:
        """What state averaging averages, flat on the CPU."""

    @abstractmethod
    def load_averaged_state(self, flat: torch.Tensor) -> None:
        """Loads :meth:`averaged_state`'s layout back."""

    @abstractmethod
    def averaged_numel(self) -> int:
        """Elements of :meth:`averaged_state`, without building it."""

    def load_agreed(self, flat: torch.Tensor) -> None:
        """Loads a state the group agreed on (:meth:`averaged_state`'s layout) that a joiner downloaded."""
        self.load_averaged_state(flat)

    def template(self) -> Template:
        """The names, shapes and dtypes of a training state of this mode."""
        return self.host.local.template()

    def capture(self, step: int, shared: bool = False) -> TrainingState:
        """CPU copies of the state at ``step`` (the caller holds the step lock). ``shared``: the model as the
        swarm shares it (diloco: the shared parameters, not this peer's mid-phase ones), as an export writes it."""
        return TrainingState(step, self.host.local.export_state())

    def restore(self, state: TrainingState) -> None:
        """Loads a state already checked against :meth:`template`."""
        self.host.local.import_state(state.tensors)

    @property
    def rounds_in_background(self) -> bool:
        """Whether a step's round runs beside the next step's compute (diloco with overlap)."""
        return False

    @property
    def in_flight(self) -> bool:
        """Whether a round still runs in the background (diloco with overlap)."""
        return False

    async def settled(self) -> bool:
        """Waits for a round in flight, if any, without taking it over; False if it failed."""
        return True

    def cancel(self) -> None:
        """Drops a round in flight: the state it would update is being replaced."""


class SyncMode(Mode):
    """Gradients are averaged at every global step, and every member applies the same update."""

    def batch_complete(self, view: SwarmProgress) -> bool:
        h = self.host
        samples, _ = h.evidence.counted_samples(view, h.step, h.samples)
        return samples >= h.config.target_batch_size

    async def end_step(self, expected: Expected) -> None:
        h = self.host
        trainers = await counted(expected)
        h.report.state = "averaging"
        # Others see at once that the batch is complete and join the round. Published alongside our own
        # registration rather than before it: on a slow DHT they hear of the round one request sooner.
        _, averaged = await asyncio.gather(h.publish(), self._averaged_gradients(trainers))
        if averaged is None:
            return
        async with h.step_lock:
            refused = await threads.run(h.local.apply, averaged)
            if refused is not None:
                # every member of the round got the same update and refuses it too: steps stay in agreement
                logger.error("Step %d: update not applied: %s", h.step, refused)
                h.report.steps_refused += 1
            h.step += 1
            h.samples = 0
        h.report.step = h.step
        await h.publish()
        if h.config.state_averaging_every and h.step % h.config.state_averaging_every == 0:
            await h.average_state(h.step)
        if h.step % h.config.validation_every == 0:
            await h.validate()
        if h.checkpointer is not None and h.step % h.config.checkpoint.every_steps == 0:
            await h.checkpoint()

    async def _averaged_gradients(self, expected: int) -> torch.Tensor | None:
        """This step's gradients averaged with a group, or our own if no group formed; None (and dropped) if
        they hold NaN/Inf."""
        h = self.host
        weight = float(h.samples)
        local = await threads.run(h.local.flat_mean_grad, weight)
        if not all_finite([local]):
            logger.error("Step %d: local gradients hold NaN/Inf; dropping them instead of sharing them "
                         "(lower training.lr?)", h.step)
            h.local.drop_gradients()
            h.samples = 0
            return None
        return await h.rounds.average(
            round_key(h.prefix, "grad", h.step), local, weight, expected, residual=h.local.residual,
            average_residual=h.local.average_residual, out=h.local.averaged, what=f"Step {h.step}")

    def averaged_state(self) -> torch.Tensor:
        return self.host.local.flat_state()

    def load_averaged_state(self, flat: torch.Tensor) -> None:
        self.host.local.load_flat_state(flat)

    def averaged_numel(self) -> int:
        return sum(t.numel() for t in self.host.local.state_tensors())
