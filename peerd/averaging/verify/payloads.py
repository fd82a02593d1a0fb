"""What a codec payload certifies about the values it carries, read from its header and block scales.

- The error bound of an honest reducer's coded average, per element: the 8-bit codec rounds to half a block's
  scale, and error feedback adds the residual the reducer carried from its last average of those elements.
  A reducer under verification keeps that residual within half a step of the average it codes now
  (:func:`clamp_residual`), so its coded average stays within ``ERROR_SLACK`` scales of the exact one whatever
  it carried; a stale residual from rounds ago (a span changes hands when groups change) would otherwise
  exceed any bound a member could check.
- The envelope: per coarse block (``COARSE_BLOCKS`` codec blocks), an upper bound on ``|value|``. Every rule
  peerd applies is, element by element, a convex combination of the members' rows, so an average's envelope
  stays within its coefficients' combination of the rows' envelopes: a lie concentrated on a few elements the
  sampled coordinates miss still shows there if it is large.

Only averages coded exactly, in fp16 or in 8-bit blocks have a bound (:func:`bounded`). The narrower schemes
(4 and 2 bits, top-k) work only with error feedback carrying most of what a round drops into the next, so an
honest reducer's coded average may be far from its exact one, by a residual nobody else holds: no member can
tell such an average from a lie, and none applies one unchecked unless it codes that way itself
(``round.RoundVerification``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peerd.config import CodecConfig
from peerd.wire.codec import HEADER, MIN_SCALE, Scheme

__all__ = ["COARSE_BLOCKS", "PayloadView", "bounded", "checks_averages", "clamp_residual", "envelope", "error_bound",
           "view"]

COARSE_BLOCKS = 32
ERROR_SLACK = 1.01  # |average - exact| <= 1.002 scales with the clamped residual; bf16 scales round up
FP16_RELATIVE, FP16_ABSOLUTE = 2.0**-10, 2.0**-23  # twice fp16's rounding (its chunks carry no residual)
ENVELOPE_SLACK = 1.02  # a coded value exceeds the exact one by its rounded-up scale and the clamped residual
TINY = 127 * 4 * MIN_SCALE


@dataclass(frozen=True)
class PayloadView:
    scheme: Scheme
    numel: int
    block: int  # INT8 block size; 0 otherwise
    scales: torch.Tensor | None  # INT8: one float32 scale per block


def view(payload: bytes | bytearray) -> PayloadView:
    """The scheme and scales of a payload that already decoded without error (so its layout is valid)."""
    _, _, scheme, _, ndim, block, _, numel = HEADER.unpack_from(payload)
    head = HEADER.size + 8 * ndim
    if Scheme(scheme) is not Scheme.INT8_BLOCKWISE:
        return PayloadView(Scheme(scheme), numel, 0, None)
    nblocks = -(-numel // block)
    raw = torch.frombuffer(bytearray(payload[head : head + 2 * nblocks]), dtype=torch.bfloat16)
    return PayloadView(Scheme.INT8_BLOCKWISE, numel, block, raw.float())


def bounded(payload: PayloadView) -> bool:
    """Whether an honest reducer's average coded as ``payload`` is within a known bound of its exact one."""
    return payload.scheme in (Scheme.RAW, Scheme.FP16, Scheme.INT8_BLOCKWISE)


def checks_averages(codec: CodecConfig) -> bool:
    """Whether a peer coding with ``codec`` codes every average it reduces within a bound (:func:`bounded`),
    and so checks every average it applies: exact or 8-bit codes, not the narrower ones error feedback
    carries."""
    return codec.lossless or codec.scheme == "blockwise8"


def error_bound(payload: PayloadView, decoded: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """For the elements ``index`` of a reducer's coded average (``decoded``): how far an honest reducer's
    coded value may be from its exact average, float64."""
    if payload.scales is not None:
        return payload.scales[index // payload.block].double() * ERROR_SLACK + TINY
    if payload.scheme is Scheme.FP16:
        return decoded[index].double().abs() * FP16_RELATIVE + FP16_ABSOLUTE
    return torch.zeros(index.numel(), dtype=torch.float64)


def envelope(payload: PayloadView | None, decoded: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per coarse block of ``COARSE_BLOCKS * block_size`` elements: an upper bound on |value| (float32).
    From the scales when the payload's blocks are the configured ones, else from the values."""
    coarse = COARSE_BLOCKS * block_size
    blocks = -(-decoded.numel() // coarse)
    if payload is not None and payload.scales is not None and payload.block == block_size:
        scales = payload.scales
        padded = torch.zeros(blocks * COARSE_BLOCKS)
        padded[: scales.numel()] = scales
        return padded.view(blocks, COARSE_BLOCKS).amax(1).mul_(127.0)
    if not blocks:
        return torch.zeros(0)
    full = decoded.numel() // coarse
    bound = torch.empty(blocks)
    if full:  # max and min apart, without a temporary of |values| (torch.aminmax is ~5x slower on CPU)
        rows = decoded[: full * coarse].view(full, coarse).float()
        torch.maximum(rows.amin(1).neg_(), rows.amax(1), out=bound[:full])
    if blocks > full:
        bound[full] = float(decoded[full * coarse :].abs().max())
    return bound


def clamp_residual(average: torch.Tensor, residual: torch.Tensor, block_size: int, int8: bool) -> None:
    """Keeps a reducer's carried residual within half a codec step of ``average`` in every block (``int8``: the
    chunk is coded blockwise), or drops it for chunks coded otherwise."""
    if not int8:
        residual.zero_()
        return
    numel = average.numel()
    full = numel // block_size
    if full:
        blocks = average[: full * block_size].view(full, block_size)
        bound = torch.maximum(blocks.amin(1).neg_(), blocks.amax(1)).div_(254.0).unsqueeze(1)
        rows = residual[: full * block_size].view(full, block_size)
        torch.clamp(rows, min=-bound, max=bound, out=rows)
    if numel > full * block_size:
        tail = float(average[full * block_size :].abs().max()) / 254.0
        residual[full * block_size :].clamp_(-tail, tail)
