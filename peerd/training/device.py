"""Where a peer computes: resolving ``training.device``, moving batches there, and autocast for bf16.

Only the model and its batches live on the device. Everything that crosses the wire (gradients, pseudo-
gradients, averages) is staged through CPU buffers that are allocated once and reused, pinned when the device
is a CUDA GPU so copies to and from it can run asynchronously.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from peerd.errors import ConfigError

FIELD = "training.device"


def resolve_device(name: str) -> torch.device:
    """``auto`` -> the first CUDA GPU if torch sees one, else the CPU; anything else must be available."""
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ConfigError(
                f"{FIELD} is {name!r}, but torch sees no CUDA GPU (torch {torch.__version__}, {build}): use "
                f"'auto' or 'cpu', or install a CUDA build of torch on a machine with a GPU",
                field=FIELD,
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"{FIELD} is {name!r}, but torch sees {torch.cuda.device_count()} CUDA GPU(s): use cuda:0.."
                f"{torch.cuda.device_count() - 1}",
                field=FIELD,
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{FIELD} is 'mps', but this machine or torch build has no MPS backend: use 'cpu'",
                          field=FIELD)
    return device


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """bfloat16 autocast for ``precision == 'bf16'`` (on CPU too), else nothing."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def host_buffer(numel: int, device: torch.device) -> torch.Tensor:
    """A reusable float32 CPU buffer for wire payloads; pinned when copies go to or from a CUDA device."""
    return torch.empty(numel, pin_memory=device.type == "cuda")


def zeros_on_touch(numel: int) -> torch.Tensor:
    """A float32 CPU tensor of zeros whose pages take memory only once written: numpy's zeros come from calloc,
    which maps large blocks from the kernel's zero pages, where torch.zeros writes every byte. For buffers of
    which a round touches a part (a reducer's residual is its span's, 1/n of the model) or none at all."""
    return torch.from_numpy(np.zeros(numel, dtype=np.float32))


def flat_views(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs each tensor with its slice of ``flat`` (laid out one after the other), shaped like it."""
    offset = 0
    for t in tensors:
        yield t, flat[offset : offset + t.numel()].view_as(t)
        offset += t.numel()
