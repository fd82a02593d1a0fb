"""Training state as named tensors, checked against what this peer expects before anyone uses it.

A :class:`TrainingState` is a step and an ordered dict of named CPU tensors (dense, contiguous); the trainer
decides the names. Whatever brings a state in, a peer (:mod:`peerd.training.transfer.server`) or a checkpoint file
(:mod:`peerd.training.checkpoint`), :func:`check_state` compares it with the receiver's :data:`Template`:
the same names exactly, each with the template's shape and dtype, dense, floating-point values finite and
booleans 0 or 1. This module knows nothing of models or optimizers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from peerd.errors import StateError

__all__ = ["Template", "TrainingState", "check_state", "template_of"]

# What a receiver expects: name -> (shape, dtype).
Template = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass
class TrainingState:
    step: int
    tensors: dict[str, torch.Tensor]  # CPU, dense, contiguous; insertion order is transfer order
    # sha256 of each tensor's bytes, in order (:mod:`peerd.training.transfer.digest`): a donor announces them
    # and a joiner checks each tensor against its digest; None: not known
    digests: tuple[bytes, ...] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def template_of(state: TrainingState) -> Template:
    return {name: (tuple(t.shape), t.dtype) for name, t in state.tensors.items()}


def check_state(state: TrainingState, template: Template, source: str) -> None:
    """Raises StateError naming ``source`` and the first offending tensor unless ``state`` fits ``template``.

    Everything is checked by type first: a state read from a file or a peer may hold anything where a tensor
    or a number belongs."""
    if type(state.step) is not int or state.step < 0:  # bool is an int subclass, and no step
        raise StateError(f"{source}: invalid step {_short(state.step)}", source=source)
    if not isinstance(state.tensors, dict):
        raise StateError(f"{source}: tensors are a {type(state.tensors).__name__}, not a dict", source=source)
    missing = [name for name in template if name not in state.tensors]
    extra = [name for name in state.tensors if name not in template]
    if missing or extra:
        raise StateError(f"{source}: tensor names differ from this peer's: missing {_names(missing)}, "
                         f"unexpected {_names(extra)}", source=source)
    for name, (shape, dtype) in template.items():
        tensor = state.tensors[name]
        if not _dense(tensor):
            raise StateError(f"{source}: tensor {name} is not a dense, contiguous CPU tensor", source=source)
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise StateError(f"{source}: tensor {name} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} "
                             f"{shape}", source=source)
        if tensor.is_floating_point() and not _all(tensor, lambda part: torch.isfinite(part).all()):
            raise StateError(f"{source}: tensor {name} holds NaN or Inf", source=source)
        # a bool tensor built from foreign bytes may hold other values than 0 and 1: torch's behaviour on
        # those is undefined
        if tensor.dtype == torch.bool and not _all(tensor.view(torch.uint8), lambda part: (part <= 1).all()):
            raise StateError(f"{source}: tensor {name} holds booleans other than 0 and 1", source=source)


def _all(tensor: torch.Tensor, test: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """``test`` holds for every slice of ``tensor``: slices of 256K elements keep the temporaries torch makes
    (an isfinite of a 1 GB tensor makes several hundred MB of them) small."""
    flat, step = tensor.reshape(-1), 1 << 18
    return all(bool(test(flat[at : at + step])) for at in range(0, flat.numel(), step))


def _names(names: list[Any]) -> str:
    shown = ", ".join(_short(n) for n in names[:5])
    return f"[{shown}{', ...' if len(names) > 5 else ''}] ({len(names)})"


def _short(value: Any) -> str:
    return repr(value)[:80] if isinstance(value, (str, int, float, type(None))) else type(value).__name__


def _dense(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.layout == torch.strided and value.device.type == "cpu"
            and value.is_contiguous() and not value.is_quantized)
