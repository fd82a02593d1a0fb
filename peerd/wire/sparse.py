"""Which elements of a top-k payload travel: their positions, Elias-Fano coded (format in
``protocols/codec.v1.md``, version 3).

``k`` sorted positions in ``[0, n)`` cost about ``k * (2 + log2(n / k))`` bits: each position's low ``l`` bits
as they are (``l = floor(log2(n / k))``), and its high bits as gaps in unary, one set bit per position in a
bitmap of ``k + ((n - 1) >> l) + 1`` bits. At 1.56% density that is 8 bits a position, where a 16-bit offset
would take 16 or a bitmap 64. The size depends only on ``n`` and ``k``, so a decoder knows it before reading.
"""

from __future__ import annotations

import torch

__all__ = ["decode_positions", "encode_positions", "low_bits", "positions_size"]


def low_bits(n: int, k: int) -> int:
    """``floor(log2(n / k))``, the low bits kept as they are (0 for k = 0)."""
    return max(0, (n // k).bit_length() - 1) if k else 0


def _bit_count(n: int, k: int) -> int:
    if k == 0:
        return 0
    low = low_bits(n, k)
    return k * low + k + ((n - 1) >> low) + 1


def positions_size(n: int, k: int) -> int:
    """Bytes of ``k`` coded positions in ``[0, n)``: whole 16-bit words, so that the bf16 scales after them
    stay aligned."""
    return 2 * -(-_bit_count(n, k) // 16)


def _pack_bits(bits: torch.Tensor, out: memoryview) -> None:
    padded = torch.zeros(len(out) * 8, dtype=torch.uint8)
    padded[: bits.numel()] = bits
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    torch.frombuffer(out, dtype=torch.uint8, count=len(out)).copy_((padded.view(-1, 8) * weights).sum(1))


def _unpack_bits(data: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((data.unsqueeze(1) >> shifts) & 1).reshape(-1)


def encode_positions(positions: torch.Tensor, n: int, out: memoryview) -> None:
    """Codes strictly increasing int64 ``positions`` in ``[0, n)`` into ``out`` (``positions_size`` bytes)."""
    k = positions.numel()
    if k == 0:
        return
    low = low_bits(n, k)
    lows = ((positions.unsqueeze(1) >> torch.arange(low)) & 1).to(torch.uint8).reshape(-1)
    highs = torch.zeros(k + ((n - 1) >> low) + 1, dtype=torch.uint8)
    highs[(positions >> low) + torch.arange(k)] = 1
    _pack_bits(torch.cat([lows, highs]), out)


def decode_positions(data: torch.Tensor, n: int, k: int) -> torch.Tensor | str:
    """The positions ``encode_positions`` coded into the uint8 ``data``, or why ``data`` is not such a coding
    (positions not strictly increasing, past ``n``, a wrong count of set bits, padding bits set)."""
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    low, count = low_bits(n, k), _bit_count(n, k)
    bits = _unpack_bits(data)
    if bool(bits[count:].any()):
        return "non-zero bits after the positions"
    lows = bits[: k * low].view(k, low).to(torch.int64)
    set_bits = torch.nonzero(bits[k * low : count]).view(-1)
    if set_bits.numel() != k:
        return f"{set_bits.numel()} positions coded where the header announces {k}"
    positions = ((set_bits - torch.arange(k)) << low) | (lows << torch.arange(low)).sum(1)
    if k > 1 and not bool((positions[1:] > positions[:-1]).all()):
        return "positions not strictly increasing"
    if int(positions[-1]) >= n:
        return f"position {int(positions[-1])} past the {n} elements"
    return positions
