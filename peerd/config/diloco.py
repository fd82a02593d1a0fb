"""The ``training.diloco`` section: local SGD with an outer optimizer (DiLoCo), for slow links."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from peerd.config.base import Section


class DilocoConfig(Section):
    """``training.mode: diloco``: each peer takes inner steps alone; a phase's parameter change (the
    pseudo-gradient) is averaged 8-bit with error feedback and applied by an outer Nesterov SGD."""

    inner_steps: int = Field(
        default=100, ge=1,
        description="H: inner optimizer steps (of accumulate micro-batches each) per peer per phase. A phase ends "
        "when the "
        "trainers in it have taken H steps each on average (phase_end: swarm) or when each has taken exactly "
        "H (phase_end: lockstep).",
    )
    accumulate: int = Field(
        default=1, ge=1, le=4096,
        description="Micro-batches whose gradients each inner step sums (gradient accumulation: a larger inner "
        "batch than fits in memory at once). A phase is inner_steps x accumulate micro-batches per peer.",
    )
    phase_end: Literal["swarm", "lockstep"] = Field(
        default="swarm",
        description="'swarm': a phase ends for everyone when the trainers at it have together taken H inner "
        "steps per trainer (progress records); faster peers take more steps than slower ones, nobody waits, "
        "and each pseudo-gradient is weighted by its samples. 'lockstep': each peer takes exactly H steps and "
        "its round waits (at most training.lockstep_timeout) for the others' (with overlap, while the next "
        "phase computes): equal samples, and without overlap reproducible runs.",
    )
    outer_lr: float = Field(default=0.7, gt=0, allow_inf_nan=False, description="Outer SGD learning rate.")
    outer_momentum: float = Field(
        default=0.9, ge=0, lt=1,
        description="Outer SGD momentum. Unset, it is 0 with averaging.codec.scheme topk: top-k's error-feedback "
        "residual already carries what each round leaves out, as a momentum would (SparseLoCo), so the two "
        "together overshoot. Peers of a swarm must agree on it.",
    )
    nesterov: bool = Field(default=True, description="Nesterov momentum for the outer SGD.")
    matchmaking_window: float = Field(
        default=5.0, gt=0, allow_inf_nan=False,
        description="Seconds the first peer to end a phase waits for the others at that phase before the outer "
        "round's groups are fixed (it closes at once when all of them are in). Longer than "
        "averaging.matchmaking_window: a peer learns that a phase ended from progress records, a read or two "
        "later than the first, and one left out steps alone; with overlap the wait delays only when the update "
        "lands, not the computing.",
    )
    overlap: bool = Field(
        default=True,
        description="Average a phase's pseudo-gradients while the next phase computes, folding the outer "
        "update in when it lands (one phase delayed); false: stop computing until the round is done.",
    )
