"""The trainer's state as named tensors: what checkpoints hold and what joiners download.

Names: ``model/<state_dict key>`` and ``inner/<parameter index>/<slot>`` (the optimizer of sync mode, or
diloco's inner one), plus diloco's ``outer/shared`` and ``outer/momentum``. A diloco peer serves joiners its
shared parameters as the model (they start the phase from theta, not from its mid-phase weights) but
checkpoints its own, so a resumed peer keeps its progress in the phase.
"""

from __future__ import annotations

from peerd.training.local import LocalModel
from peerd.training.outer import OuterState
from peerd.training.state import Template, TrainingState


def template(local: LocalModel, outer: OuterState | None) -> Template:
    layout = local.template()
    if outer is not None:
        layout.update({name: (tuple(t.shape), t.dtype) for name, t in outer.named().items()})
    return layout


def capture(local: LocalModel, outer: OuterState | None, step: int, for_joiner: bool = False) -> TrainingState:
    """CPU copies of the state at ``step``; the caller keeps the weights still meanwhile (the step lock)."""
    tensors = local.export_state(parameters=outer.shared if outer is not None and for_joiner else None)
    if outer is not None:
        tensors.update({name: t.detach().to("cpu", copy=True).contiguous() for name, t in outer.named().items()})
    return TrainingState(step, tensors)


def restore(local: LocalModel, outer: OuterState | None, state: TrainingState) -> None:
    """Loads a state already checked against :func:`template`."""
    local.import_state(state.tensors)
    if outer is not None:
        outer.load_named(state.tensors)
