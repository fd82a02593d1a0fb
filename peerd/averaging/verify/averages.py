"""What a member reads off the averages of a batch of chunks it received, all chunks at once: their values at the
sampled coordinates, how far an honest reducer's coded values may be from its exact average there, and per coarse
block their envelope, norm and coding error (payloads.py says what each bound means). A batch is chunks of one
span of the same size and code; chunks of 8-bit blocks that tile their coarse blocks exactly, as every full chunk
of the default layout does, are read with one operation per quantity instead of a few per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peerd.averaging.verify.payloads import (
    COARSE_BLOCKS,
    ERROR_SLACK,
    TINY,
    PayloadView,
    block_norms,
    envelope,
    error_bound,
    error_norms,
)
from peerd.wire.codec import Scheme

__all__ = ["envelopes", "error_bounds", "error_norms_of", "norms_of", "sampled"]


def _tiled(payloads: Sequence[PayloadView], block_size: int) -> torch.Tensor | None:
    """The payloads' block scales (chunks x codec blocks) if every one is 8-bit blocks of ``block_size`` over a
    whole number of coarse blocks, else None."""
    coarse = COARSE_BLOCKS * block_size
    for payload in payloads:
        if payload.scheme is not Scheme.INT8_BLOCKWISE or payload.block != block_size or payload.scales is None or \
                payload.numel % coarse or payload.numel != payloads[0].numel:
            return None
    return torch.stack([payload.scales for payload in payloads])  # type: ignore[misc]


def _joined(outs: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One view over the chunks ``outs`` if each starts where the one before it ends in the same tensor."""
    first = outs[0]
    if not first.is_contiguous():
        return None
    end = first.data_ptr() + first.numel() * first.element_size()
    for out in outs[1:]:
        if not out.is_contiguous() or out.data_ptr() != end or out.untyped_storage().data_ptr() != \
                first.untyped_storage().data_ptr():
            return None
        end += out.numel() * out.element_size()
    total = sum(out.numel() for out in outs)
    return first.as_strided((total,), (1,))


def sampled(outs: Sequence[torch.Tensor], offsets: torch.Tensor) -> torch.Tensor:
    """The averages at the sampled ``offsets`` (chunks x samples), float64."""
    joined = _joined(outs)
    if joined is not None and all(out.numel() == outs[0].numel() for out in outs):
        starts = torch.arange(len(outs), dtype=torch.int64).mul_(outs[0].numel()).unsqueeze(1)
        return joined[offsets + starts].double()
    return torch.stack([out[index] for out, index in zip(outs, offsets, strict=True)]).double()


def error_bounds(payloads: Sequence[PayloadView], outs: Sequence[torch.Tensor], offsets: torch.Tensor,
                 required: Sequence[int], block_size: int) -> torch.Tensor:
    """:func:`payloads.error_bound` of every chunk at its ``offsets`` (chunks x samples)."""
    scales = _tiled(payloads, block_size)
    if scales is not None:
        return torch.gather(scales, 1, offsets // block_size).double() * ERROR_SLACK + TINY
    return torch.stack([error_bound(payload, out, index, least) for payload, out, index, least in
                        zip(payloads, outs, offsets, required, strict=True)])


def envelopes(payloads: Sequence[PayloadView], outs: Sequence[torch.Tensor], block_size: int) -> torch.Tensor:
    """:func:`payloads.envelope` of every chunk (chunks x coarse blocks), float64."""
    scales = _tiled(payloads, block_size)
    if scales is not None:
        return scales.view(len(payloads), -1, COARSE_BLOCKS).amax(2).mul_(127.0).double()
    return torch.stack([envelope(payload, out, block_size) for payload, out in
                        zip(payloads, outs, strict=True)]).double()


def norms_of(outs: Sequence[torch.Tensor], block_size: int) -> torch.Tensor:
    """:func:`payloads.block_norms` of every chunk (chunks x coarse blocks), float64."""
    coarse = COARSE_BLOCKS * block_size
    joined = _joined(outs)
    if joined is not None and outs[0].numel() % coarse == 0:
        return block_norms(joined, block_size).view(len(outs), -1)
    return torch.stack([block_norms(out, block_size) for out in outs])


def error_norms_of(payloads: Sequence[PayloadView], outs: Sequence[torch.Tensor], block_size: int) -> torch.Tensor:
    """:func:`payloads.error_norms` of every chunk (chunks x coarse blocks), float64."""
    scales = _tiled(payloads, block_size)
    if scales is not None:  # every codec block whole inside one coarse block
        per_block = (scales.double() * ERROR_SLACK + TINY) ** 2 * block_size
        return per_block.view(len(payloads), -1, COARSE_BLOCKS).sum(2).sqrt_()
    return torch.stack([error_norms(payload, out, block_size) for payload, out in zip(payloads, outs, strict=True)])
