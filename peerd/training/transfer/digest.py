"""Digests of the state a group agrees on, so a joiner loads only what several members vouch for.

After a lossless state averaging (both modes) or a diloco outer round, the members of the group hold the
same bits of what state averaging averages: one flat float32 tensor (:meth:`peerd.training.modes.Mode.
averaged_state`). A member keeps a copy of it as a :class:`Snapshot`, cut into pieces of at most
:data:`PIECE_NUMEL` elements, with each piece's sha256 and a root digest over the step, the pieces' layout and
their digests. The root goes into the member's signed progress record; members that agree publish the same
one. A joiner checks each piece against its digest as it completes (a donor that sent a bad piece is caught
on that piece, and a download that switches donors restarts only the current piece) and the manifest's
pieces against the root it chose.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from peerd.training.state import Template, TrainingState

__all__ = ["PIECE_NUMEL", "Snapshot", "piece_template", "root_digest", "take_snapshot", "tensor_digest"]

# 32 MiB of float32: what a download that switches donors fetches twice at most, and few enough pieces for a
# manifest (a 2 GiB state has 64).
PIECE_NUMEL = 1 << 23
PIECE_PREFIX = "shared/"
DIGEST_BYTES = 32
_DOMAIN = b"peerd.v1.state\0"


def piece_names(numel: int) -> list[str]:
    return [f"{PIECE_PREFIX}{i:05d}" for i in range(max(1, -(-numel // PIECE_NUMEL)))]


def piece_template(numel: int, dtype: torch.dtype = torch.float32) -> Template:
    """The names, shapes and dtype of a flat tensor of ``numel`` elements cut into pieces (one empty piece
    for an empty tensor: a state has at least one tensor)."""
    names = piece_names(numel)
    sizes = [min(PIECE_NUMEL, numel - i * PIECE_NUMEL) for i in range(len(names))]
    return {name: ((max(0, size),), dtype) for name, size in zip(names, sizes, strict=True)}


def pieces(flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of ``flat`` (1-D, contiguous, on the CPU), named as :func:`piece_template` names them."""
    template = piece_template(flat.numel(), flat.dtype)
    views, at = {}, 0
    for name, ((size,), _) in template.items():
        views[name] = flat[at : at + size]
        at += size
    return views


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """sha256 of a contiguous CPU tensor's bytes, as they travel."""
    h = hashlib.sha256()
    if tensor.numel():
        h.update(tensor.detach().reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


def root_digest(step: int, layout: Template, digests: tuple[bytes, ...]) -> bytes:
    """Binds the step, every tensor's name, dtype and shape, and its digest, in transfer order."""
    h = hashlib.sha256(_DOMAIN)
    h.update(step.to_bytes(8, "little"))
    for (name, (shape, dtype)), digest in zip(layout.items(), digests, strict=True):
        h.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\0".encode())
        h.update(digest)
    return h.digest()


@dataclass(frozen=True)
class Snapshot:
    """This member's copy of the state it last agreed on with a group, at ``step``. Never changed after it is
    taken: a transfer may read it while a newer one replaces it."""

    step: int
    flat: torch.Tensor
    digests: tuple[bytes, ...]  # of each piece, in order
    root: bytes

    def state(self) -> TrainingState:
        return TrainingState(self.step, pieces(self.flat), self.digests)


def take_snapshot(step: int, flat: torch.Tensor) -> Snapshot:
    """Hashes ``flat`` (which the snapshot then owns: pass a copy) piece by piece; runs in a worker thread."""
    flat = flat.detach().reshape(-1).contiguous()
    views = pieces(flat)
    digests = tuple(tensor_digest(view) for view in views.values())
    layout = {name: (tuple(view.shape), view.dtype) for name, view in views.items()}
    return Snapshot(step, flat, digests, root_digest(step, layout, digests))
