"""The arithmetic of the 8-bit blockwise scheme, below :mod:`peerd.wire.codec` (which owns the payload format and
its validation): per block of ``block`` elements one bf16 scale, rounded up from ``absmax / 127``, and one int8
code per element, ``round(x / scale)`` half to even.

fp32 input, what every averaging round sends, is encoded by the C kernel ``peerd/wire/_blockwise.c`` built with
the package: it reads each block from memory once, takes its absmax while the block sits in L1 cache and
codes it from there, on the calling thread. Elsewhere (fp16/bf16 input, or a build without a C compiler, see
:func:`kernel`) the same arithmetic runs as fused torch passes over cache-sized chunks, which read the input
about three times over; both give the same bytes (tests/unit/test_blockwise.py). Decoding is one fused
multiply per chunk in torch, as fast as a copy, so it has no kernel.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

_blockwise: ModuleType | None
try:
    from peerd.wire import _blockwise
except ImportError:  # built without a C compiler: the torch path encodes fp32 too
    _blockwise = None

__all__ = [
    "CHUNK_NUMEL", "MAX_SCALE", "MAX_SCALES", "MIN_SCALE", "QMAX", "dequantize", "kernel", "pack", "quantize",
    "torch_path", "unpack",
]



def kernel() -> str:
    """What encodes fp32 blocks in this process: the C kernel's instruction set (``"avx2"``, ``"sse2"`` or
    ``"scalar"``), or ``"torch"`` in a build without it (several times slower; status shows it)."""
    return _blockwise.isa() if _blockwise is not None else "torch"


@contextmanager
def torch_path() -> Iterator[None]:
    """Within it, this process encodes as a build without the C kernel does (benchmarks and tests compare the
    two)."""
    global _blockwise
    kernel, _blockwise = _blockwise, None
    try:
        yield
    finally:
        _blockwise = kernel


def _f32_bits(value: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def _bf16_floor(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<I", _f32_bits(value) & 0xFFFF0000))[0])


# Scales are rounded *up* to bf16 (fp32's range in 2 bytes), so no code exceeds 127; the floor gives all-zero
# blocks a finite reciprocal, the ceiling keeps 127 * scale finite in fp32.
MIN_SCALE = 2.0**-126
MAX_SCALE = _bf16_floor(torch.finfo(torch.float32).max / 127)
# code width -> largest code: two's complement codes, the most negative one never emitted (so 0 is exact and the
# range symmetric). 2 bits make -1, 0 and 1: a sign and a zero per element.
QMAX = {8: 127, 4: 7, 2: 1}
# code width -> the largest scale whose QMAX multiple stays finite in fp32
MAX_SCALES = {bits: _bf16_floor(torch.finfo(torch.float32).max / q) for bits, q in QMAX.items()}
# Elements per fused torch pass: its fp32 scratch (2 MiB) stays in cache, so a chunk comes from DRAM only once
# per pass.
CHUNK_NUMEL = 1 << 19


def _spans(numel: int, block: int) -> Iterator[tuple[int, int, int, int]]:
    """(first element, first block, rows, row width) of each fused pass: chunks of whole blocks, then the
    partial last block on its own, so that every chunk is a zero-copy 2-d view of the flat tensor."""
    full, step = numel // block, max(1, CHUNK_NUMEL // block)
    for first in range(0, full, step):
        yield first * block, first, min(step, full - first), block
    if numel > full * block:
        yield full * block, full, 1, numel - full * block


def quantize(flat: torch.Tensor, scales: memoryview, codes: memoryview, block: int, bits: int = 8) -> bool:
    """Encodes the contiguous 1-d ``flat`` into ``scales`` (bf16 bits, one per block) and ``codes`` (one int8 per
    element, in [-QMAX[bits], QMAX[bits]]); False if ``flat`` holds NaN or Inf (the outputs are then
    unspecified)."""
    if _blockwise is not None and flat.dtype == torch.float32 and bits == 8:
        return bool(_blockwise.quantize(flat.numpy(), scales, codes, block, MAX_SCALE))
    return _quantize_torch(flat, scales, codes, block, bits)


def _quantize_torch(
    flat: torch.Tensor, scales_out: memoryview, codes_out: memoryview, block: int, bits: int
) -> bool:
    numel, nblocks = flat.numel(), -(-flat.numel() // block)
    codes = torch.frombuffer(codes_out, dtype=torch.int8, count=numel)
    absmax, scales = torch.empty(nblocks), torch.empty(nblocks)
    scratch = torch.empty(min(numel, max(1, CHUNK_NUMEL // block) * block))
    for start, first, rows, width in _spans(numel, block):
        end, stop = start + rows * width, first + rows
        values, chunk_codes = flat[start:end].view(rows, width), codes[start:end].view(rows, width)
        tmp = scratch[: end - start].view(rows, width)
        _quantize_rows(values, chunk_codes, absmax[first:stop], scales[first:stop], tmp, bits)
    if not torch.isfinite(absmax.max()):  # amax propagates NaN, so one check covers every element
        return False
    # The scales hold bf16 values already (rounded up in _quantize_rows), so narrowing them is exact.
    torch.frombuffer(scales_out, dtype=torch.bfloat16, count=nblocks).copy_(scales)
    return True


def _quantize_rows(
    rows: torch.Tensor,
    codes: torch.Tensor,
    absmax: torch.Tensor,
    scales: torch.Tensor,
    tmp: torch.Tensor,
    bits: int,
) -> None:
    if rows.dtype == torch.float32:
        torch.amax(torch.abs(rows, out=tmp), dim=1, out=absmax)
        src = rows
    else:  # widen once; the reductions and the product then run on the fp32 copy
        src = tmp.copy_(rows)
        torch.maximum(src.amax(dim=1), src.amin(dim=1).neg_(), out=absmax)
    torch.mul(absmax, 1 / QMAX[bits], out=scales)
    # Round up to bf16 by carrying into the high half of the fp32 bits (scales are non-negative here).
    scales.view(torch.int32).add_(0xFFFF).bitwise_and_(-0x10000)
    scales.clamp_(MIN_SCALE, MAX_SCALES[bits])
    # No clamp of the codes needed: |x| / MAX_SCALES[bits] <= float32 max / MAX_SCALES[bits], at most QMAX times
    # 1 + 2**-7 (the bf16 rounding down of MAX_SCALES), rounds to QMAX.
    torch.mul(src, scales.reciprocal().unsqueeze(1), out=tmp).round_()
    codes.copy_(tmp)


def pack(codes: torch.Tensor, out: memoryview, bits: int) -> None:
    """Packs int8 ``codes`` of ``bits`` (4 or 2) bits each into ``out``, low bits first: element ``i`` in byte
    ``i * bits // 8`` at bit ``i * bits % 8``; the last byte's unused bits are 0."""
    per_byte = 8 // bits
    fields = torch.zeros(len(out) * per_byte, dtype=torch.uint8)
    torch.bitwise_and(codes.view(torch.uint8), (1 << bits) - 1, out=fields[: codes.numel()])
    lanes = fields.view(-1, per_byte)
    packed = torch.frombuffer(out, dtype=torch.uint8, count=len(out))
    packed.copy_(lanes[:, 0])
    for lane in range(1, per_byte):
        packed.bitwise_or_(lanes[:, lane] << (bits * lane))


def unpack(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor | str:
    """The int8 codes ``pack`` wrote into the uint8 ``packed``, or why they are not what it writes."""
    per_byte, half = 8 // bits, 1 << (bits - 1)
    fields = torch.stack([(packed >> (bits * lane)) & ((1 << bits) - 1) for lane in range(per_byte)], dim=1)
    codes = (fields.view(torch.int8) ^ half) - half  # sign-extends the two's complement fields
    flat = codes.view(-1)
    if flat.numel() > numel and bool(flat[numel:].any()):
        return "non-zero bits after the last code"
    return flat[:numel]


def dequantize(
    raw_scales: torch.Tensor, codes: torch.Tensor, block: int, flat: torch.Tensor, bits: int = 8
) -> str | None:
    """Decodes int16-viewed bf16 ``raw_scales`` and int8 ``codes`` of ``bits`` into ``flat``, or, before writing
    anything, returns why they are not what an encoder emits."""
    qmax, max_scale = QMAX[bits], MAX_SCALES[bits]
    top = _f32_bits(max_scale) >> 16
    low, high = (int(v) for v in torch.aminmax(raw_scales))
    if low < 0 or high > top:  # bit order = value order for non-negative bf16; NaN/Inf sort above
        bad = raw_scales[(raw_scales < 0) | (raw_scales > top)][0].view(torch.bfloat16).item()
        return f"block scale {bad} is negative, NaN, Inf or above {max_scale:.4e}"
    lowest = int(codes.min())
    if lowest < -qmax:  # the encoder never emits the most negative code; larger ones do not fit the width
        return f"code {lowest} (the encoder only emits [-{qmax}, {qmax}])"
    numel = flat.numel()
    scales = raw_scales.view(torch.bfloat16).float()
    # fp16/bf16 results go through an fp32 scratch and saturate, since a rounded-up scale may overshoot 65504.
    narrow = flat.dtype != torch.float32
    scratch = torch.empty(min(numel, max(1, CHUNK_NUMEL // block) * block)) if narrow else None
    limit = torch.finfo(flat.dtype).max
    for start, first, rows, width in _spans(numel, block):
        end = start + rows * width
        out = flat[start:end].view(rows, width)
        target = out if scratch is None else scratch[: end - start].view(rows, width)
        target.copy_(codes[start:end].view(rows, width)).mul_(scales[first : first + rows].unsqueeze(1))
        if scratch is not None:
            out.copy_(target.clamp_(-limit, limit))
    return None
