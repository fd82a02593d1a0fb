"""Training state as bytes, for checkpoints and for late joiners downloading it from a peer.

The same validated format serves both: ``torch.save`` of a plain dict (tensors, numbers, strings) loaded
back with ``weights_only=True`` (no pickle code execution), then checked against our own model: format tag,
fingerprint, every parameter's name, shape and dtype, and finiteness. A foreign, truncated or corrupt blob
raises a clear error and leaves the model untouched.
"""

from __future__ import annotations

import io
import math
from typing import Any

import torch

from peerd.errors import StateError

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


def _short(value: Any) -> str:
    return repr(value)[:80] if isinstance(value, (str, int, float, type(None))) else type(value).__name__


def _dense(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and value.device.type == "cpu"


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
