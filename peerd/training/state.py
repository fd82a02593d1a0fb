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
    """Validates ``blob`` against ``model`` and loads it; returns the step. ``source`` names it in errors."""
    try:
        state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises several types (EOFError, RuntimeError, UnpicklingError, ...)
        raise StateError(f"{source}: not a readable peerd state ({type(e).__name__}: {str(e)[:200]})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise StateError(f"{source}: not a peerd training state")
    if state.get("version") != VERSION:
        raise StateError(f"{source}: state format version {state.get('version')}, this peerd reads {VERSION}")
    if state.get("fingerprint") != fingerprint:
        raise StateError(
            f"{source}: state of another model/config (fingerprint {state.get('fingerprint')}, ours {fingerprint})"
        )
    step = state.get("step")
    if not isinstance(step, int) or step < 0:
        raise StateError(f"{source}: invalid step {step!r}")
    weights = state.get("model")
    ours = model.state_dict()
    if not isinstance(weights, dict) or set(weights) != set(ours):
        raise StateError(f"{source}: parameter names differ from this model's")
    for name, tensor in weights.items():
        mine = ours[name]
        if not isinstance(tensor, torch.Tensor) or tensor.shape != mine.shape or tensor.dtype != mine.dtype:
            raise StateError(f"{source}: parameter {name} has the wrong type, shape or dtype")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise StateError(f"{source}: parameter {name} holds NaN or Inf")
    optimizer_state = _check_optimizer_state(state.get("optimizer"), source)
    backup = optimizer.state_dict()
    try:
        optimizer.load_state_dict(optimizer_state)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        optimizer.load_state_dict(backup)
        raise StateError(f"{source}: optimizer state does not fit this optimizer ({e})") from e
    model.load_state_dict(weights)
    return step


def _check_optimizer_state(state: Any, source: str) -> dict[str, Any]:
    if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
        raise StateError(f"{source}: missing or malformed optimizer state")
    for slot in state["state"].values():
        for key, value in (slot.items() if isinstance(slot, dict) else ()):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise StateError(f"{source}: optimizer state {key} holds NaN or Inf")
            if isinstance(value, float) and not math.isfinite(value):
                raise StateError(f"{source}: optimizer state {key} is not finite")
    return state
