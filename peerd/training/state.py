"""Training state as named tensors, checked against what this peer expects before anyone uses it.

A :class:`TrainingState` is a step and an ordered dict of named CPU tensors (dense, contiguous); the trainer
decides the names. Whatever brings a state in, a peer (:mod:`peerd.training.sync`) or a checkpoint file
(:mod:`peerd.training.checkpoint`), :func:`check_state` compares it with the receiver's :data:`Template`:
the same names exactly, each with the template's shape and dtype, dense, floating-point values finite and
booleans 0 or 1. This module knows nothing of models or optimizers.
"""

from __future__ import annotations

import io
import math
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


# --- TRANSITION: version 1 (one torch.save blob of a model and its optimizer), used by trainer.py until it -----
# --- produces TrainingStates; delete from here to the end of the file with it. ---------------------------------

FORMAT = "peerd.training-state"
VERSION = 1


def pack_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, fingerprint: str) -> bytes:
    buffer = io.BytesIO()
    torch.save(
        {
            "format": FORMAT,
            "version": VERSION,
            "fingerprint": fingerprint,
            "step": step,
            "model": {name: tensor.detach().clone() for name, tensor in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
        },
        buffer,
    )
    return buffer.getvalue()


def unpack_state(
    blob: bytes, model: torch.nn.Module, optimizer: torch.optim.Optimizer, fingerprint: str, source: str
) -> int:
    """Validates ``blob`` against ``model`` and loads it; returns the step. ``source`` names it in errors.

    Anything a blob can hold is checked by type before it is compared or used: ``torch.load`` of a foreign blob
    may yield tensors (whose ``==`` is elementwise and whose truth value raises), sparse tensors, or containers
    where dicts are expected."""
    try:
        state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises several types (EOFError, RuntimeError, UnpicklingError, ...)
        raise StateError(f"{source}: not a readable peerd state ({type(e).__name__}: {str(e)[:200]})") from e
    if not isinstance(state, dict) or not _is(state.get("format"), FORMAT):
        raise StateError(f"{source}: not a peerd training state")
    if not _is(state.get("version"), VERSION):
        raise StateError(f"{source}: state format version {_short(state.get('version'))}, this peerd reads {VERSION}")
    if not _is(state.get("fingerprint"), fingerprint):
        raise StateError(f"{source}: state of another model/config (fingerprint "
                         f"{_short(state.get('fingerprint'))}, ours {fingerprint})")
    step = state.get("step")
    if type(step) is not int or step < 0:  # bool is an int subclass, and no step
        raise StateError(f"{source}: invalid step {_short(step)}")
    weights = state.get("model")
    ours = model.state_dict()
    if not isinstance(weights, dict) or set(weights) != set(ours):
        raise StateError(f"{source}: parameter names differ from this model's")
    for name, tensor in weights.items():
        mine = ours[name]
        if not _dense(tensor) or tensor.shape != mine.shape or tensor.dtype != mine.dtype:
            raise StateError(f"{source}: parameter {name} has the wrong type, shape or dtype, or is not dense")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise StateError(f"{source}: parameter {name} holds NaN or Inf")
    optimizer_state = _check_optimizer_state(state.get("optimizer"), optimizer, source)
    backup = optimizer.state_dict()
    try:
        optimizer.load_state_dict(optimizer_state)
        _check_loaded(optimizer, source)
    except Exception as e:  # torch's own checks raise several types; any of them means "does not fit"
        optimizer.load_state_dict(backup)
        if isinstance(e, StateError):
            raise
        raise StateError(f"{source}: optimizer state does not fit this optimizer ({str(e)[:200]})") from e
    model.load_state_dict(weights)
    return step


def _is(value: Any, expected: str | int) -> bool:
    return type(value) is type(expected) and value == expected


def _check_optimizer_state(state: Any, optimizer: torch.optim.Optimizer, source: str) -> dict[str, Any]:
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        raise StateError(f"{source}: missing or malformed optimizer state")
    for slot in state["state"].values():
        if not isinstance(slot, dict):
            raise StateError(f"{source}: malformed optimizer state")
        for key, value in slot.items():
            if isinstance(value, torch.Tensor) and not _dense(value):
                raise StateError(f"{source}: optimizer state {_short(key)} is not a dense tensor")
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise StateError(f"{source}: optimizer state {_short(key)} holds NaN or Inf")
            if isinstance(value, float) and not math.isfinite(value):
                raise StateError(f"{source}: optimizer state {_short(key)} is not finite")
    groups, mine = state.get("param_groups"), optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(mine):
        raise StateError(f"{source}: optimizer parameter groups differ from this optimizer's")
    for group, own in zip(groups, mine, strict=True):
        # Hyperparameters are read by every later optimizer step: a string or tensor learning rate would be
        # accepted by load_state_dict and fail (or silently misbehave) there instead.
        if not isinstance(group, dict) or set(group) != set(own):
            raise StateError(f"{source}: optimizer parameter group keys differ from this optimizer's")
        for key, value in group.items():
            if key != "params" and not _same_kind(value, own[key]):
                raise StateError(f"{source}: optimizer hyperparameter {_short(key)} is {_short(value)}")
    return state


def _same_kind(value: Any, own: Any) -> bool:
    if isinstance(own, (tuple, list)):
        return (type(value) is type(own) and len(value) == len(own)
                and all(_same_kind(v, o) for v, o in zip(value, own, strict=True)))
    if isinstance(own, float):
        return type(value) in (float, int) and math.isfinite(value)
    return type(value) is type(own)


def _check_loaded(optimizer: torch.optim.Optimizer, source: str) -> None:
    """Every per-parameter state tensor is a scalar (a step count) or has its parameter's shape."""
    for param, slot in optimizer.state.items():
        for key, value in slot.items():
            if isinstance(value, torch.Tensor) and value.numel() != 1 and value.shape != param.shape:
                raise StateError(f"{source}: optimizer state {_short(key)} of shape {tuple(value.shape)} does not "
                                 f"fit its parameter of shape {tuple(param.shape)}")
