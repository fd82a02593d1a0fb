"""The body of a top-k payload (schemes TOPK8, TOPK4, TOPK2 of ``protocols/codec.v1.md``, version 3): the ``k``
largest-magnitude elements of a tensor, their positions Elias-Fano coded (:mod:`peerd.wire.sparse`) and their
values blockwise coded at 8, 4 or 2 bits (:mod:`peerd.wire.blockwise`); every other element decodes as 0.
SPARSE8 (version 4) is the TOPK8 body carrying an average's ``k`` largest elements exactly as :func:`largest` picks
them (every nonzero one if there are no more): whatever it leaves out is no larger than what it carries.

Layout: ``k`` (u64), then the positions, then ``ceil(k / block)`` bf16 scales, then the packed value codes.
What is not sent is not lost: error feedback (:mod:`peerd.wire.feedback`) carries it into the next round, so an
element travels once enough has accumulated on it to rank among the largest.
"""

from __future__ import annotations

import math
import struct

import torch

from peerd.wire import blockwise, sparse

__all__ = ["body_size", "choose_k", "decode_body", "encode_body", "largest", "read_k", "select", "support"]

_K = struct.Struct("<Q")
_SAMPLE = 1 << 16  # elements sampled to estimate the k-th largest magnitude
_MARGIN = 1.1  # the bar is set for this many times k candidates


def choose_k(numel: int, density: float) -> int:
    """Elements a payload of ``numel`` carries at ``density``: at least one, at most all."""
    return min(numel, max(1, math.ceil(density * numel)))


def _sections(numel: int, k: int, block: int, bits: int) -> tuple[int, int, int]:
    """Bytes of the positions, the scales and the value codes."""
    return sparse.positions_size(numel, k), 2 * -(-k // block), -(-k * bits // 8)


def body_size(numel: int, k: int, block: int, bits: int) -> int:
    return _K.size + sum(_sections(numel, k, block, bits))


def select(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted positions of the ``k`` largest |elements| of ``flat`` (fewer if fewer pass the estimated bar; NaN
    and Inf rank above every finite value, so one of them is always taken).

    torch.topk over millions of elements takes hundreds of milliseconds; a bar estimated from a seeded sample
    of 65,536 elements leaves a few more than ``k`` candidates in one pass, and topk runs on those alone."""
    magnitudes = flat.abs() if flat.dtype == torch.float32 else flat.float().abs()
    numel = magnitudes.numel()
    if numel <= 4 * _SAMPLE:
        return torch.topk(magnitudes, k, sorted=False).indices.sort().values
    sample = magnitudes[torch.randint(numel, (_SAMPLE,), generator=torch.Generator().manual_seed(0))]
    # a bar a little below the k-th largest in expectation, so that usually at least k pass
    rank = max(1, _SAMPLE - math.ceil(_SAMPLE * k / numel * _MARGIN))
    bar = torch.kthvalue(sample, rank).values
    candidates = torch.nonzero(magnitudes >= bar).view(-1) if not bool(torch.isnan(bar)) else torch.arange(numel)
    if candidates.numel() > k:
        candidates = candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices].sort().values
    return candidates


def largest(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted positions of the ``k`` largest |elements| of ``flat``, or of every nonzero one if there are no more
    than ``k``: never fewer, so no element left out is larger than one taken (``select`` may take fewer)."""
    if int(torch.count_nonzero(flat)) <= k:  # NaN counts as nonzero, so the value coder sees and refuses it
        return torch.nonzero(flat).view(-1)
    positions = select(flat, k)
    if positions.numel() < k:  # the sampled bar came out too high: rank every element
        magnitudes = flat.abs() if flat.dtype == torch.float32 else flat.float().abs()
        positions = torch.topk(magnitudes, k, sorted=False).indices.sort().values
    return positions


def encode_body(flat: torch.Tensor, positions: torch.Tensor, block: int, bits: int, body: memoryview) -> bool:
    """Writes the body (``body_size`` bytes for ``len(positions)``) of the elements of the contiguous 1-d
    ``flat`` at the sorted ``positions``; False if ``flat`` holds NaN or Inf (``select`` then took one of them
    and the value coder refuses it)."""
    numel, k = flat.numel(), positions.numel()
    values = flat[positions].contiguous()
    where, scales, codes = _sections(numel, k, block, bits)
    _K.pack_into(body, 0, k)
    if k == 0:  # SPARSE8 of an all-zero tensor: nothing follows the count
        return True
    at = _K.size
    sparse.encode_positions(positions, numel, body[at : at + where])
    at += where
    scale_view, code_view = body[at : at + scales], body[at + scales : at + scales + codes]
    if bits == 8:
        return blockwise.quantize(values, scale_view, code_view, block)
    if bits == 2:
        return _ternary(values, block, scale_view, code_view)
    unpacked = bytearray(k)
    if not blockwise.quantize(values, scale_view, memoryview(unpacked), block, bits):
        return False
    blockwise.pack(torch.frombuffer(unpacked, dtype=torch.int8), code_view, bits)
    return True


def _ternary(values: torch.Tensor, block: int, scales: memoryview, codes: memoryview) -> bool:
    """Codes each block of ``values`` as -s, 0 or s with the ``s`` and the zeroed elements that leave the least
    squared error; False if a value is NaN or Inf.

    The 2-bit code's absmax scale suits dense blocks, whose elements are mostly small. The values a top-k payload
    carries were chosen for being large, and one outlier per block would round the rest to 0 under the absmax
    scale: their positions sent for nothing. If the ``m`` largest of a block are sent as their mean ``s`` and
    the others as 0, the squared error is the block's sum of squares less ``(sum of the m largest)^2 / m``; the
    best ``m`` maximizes that quotient. The same format decodes it: a scale and codes in [-1, 1]."""
    k = values.numel()
    if k == 0:
        return True
    if not bool(torch.isfinite(values).all()):
        return False
    rows = -(-k // block)
    padded = torch.zeros(rows * block, dtype=torch.float64)
    padded[:k] = values
    grid = padded.view(rows, block)
    absolute = grid.abs()
    magnitudes = absolute.sort(dim=1, descending=True).values
    sums = magnitudes.cumsum(dim=1)
    best = (sums.square() / torch.arange(1, block + 1, dtype=torch.float64)).argmax(dim=1, keepdim=True)
    scale = (sums.gather(1, best) / (best + 1)).clamp_(max=blockwise.MAX_SCALES[2]).float()
    bar = magnitudes.gather(1, best)
    code = torch.where(absolute >= bar, grid.sign(), 0.0).to(torch.int8).view(-1)[:k]
    torch.frombuffer(scales, dtype=torch.bfloat16, count=rows).copy_(scale.view(-1))
    blockwise.pack(code, codes, 2)
    return True


def read_k(body: memoryview) -> int | None:
    """The ``k`` a body announces, or None if it is too short to say."""
    return _K.unpack_from(body)[0] if len(body) >= _K.size else None


def decode_body(raw: torch.Tensor, block: int, bits: int, flat: torch.Tensor) -> str | None:
    """Decodes a body (uint8, its size already checked against its ``k``) into ``flat``; or, before writing
    anything, returns why it is not what ``encode_body`` writes."""
    numel, k = flat.numel(), int(raw[: _K.size].view(torch.int64))
    where, scales, codes = _sections(numel, k, block, bits)
    at = _K.size
    positions = sparse.decode_positions(raw[at : at + where], numel, k)
    if isinstance(positions, str):
        return positions
    at += where
    raw_scales = raw[at : at + scales].view(torch.int16)
    packed = raw[at + scales : at + scales + codes]
    unpacked = packed.view(torch.int8) if bits == 8 else blockwise.unpack(packed, k, bits)
    if isinstance(unpacked, str):
        return unpacked
    values = torch.empty(k, dtype=flat.dtype)
    reason = blockwise.dequantize(raw_scales, unpacked, block, values, bits) if k else None
    if reason is not None:
        return reason
    flat.zero_()
    flat[positions] = values
    return None


def support(body: memoryview, numel: int, block: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted positions and the float32 value scales (one per ``block`` sent values) of a body that already
    decoded without error (``decode_body``), read again without copying or decoding the values."""
    k = _K.unpack_from(body)[0]
    where, scales, _ = _sections(numel, k, block, bits)
    raw = torch.frombuffer(bytearray(body[: _K.size + where + scales]), dtype=torch.uint8)
    positions = sparse.decode_positions(raw[_K.size : _K.size + where], numel, k)
    if isinstance(positions, str):
        raise TypeError(f"positions of a payload that decoded before do not decode now: {positions}")
    at = _K.size + where
    return positions, raw[at : at + scales].view(torch.int16).view(torch.bfloat16).float()
