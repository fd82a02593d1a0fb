"""A span's verification seed and what it draws: sampled coordinates and sketch directions.

Each member draws a random share for every span of the round and commits to them (blake3 of each, in its
ReduceRequests) before any reducer has seen a contribution; it reveals its share of a span only once it holds
that span's signed statement. A span's seed is blake3 over every member's share of it, so it is fixed after that
span's reducer committed to its averages, and no reducer (nor anyone short of every member together) can choose
or learn it earlier: a reducer done first learns only its own span's seed, which tells it nothing of another's.
One seed per span, not one per round, lets each span's checks run as soon as its statement is out, while the
other spans are still averaged.

From a span's seed, per chunk: ``SAMPLES`` coordinates where every member reveals its row (a reducer's
average is checked exactly there), and a sketch of ``SKETCH_SIZE`` random +-1 projections that preserves the
distances and norms of rows (the robust rules' checks). The sketch direction of projection ``i`` at element
``(b, p)`` of the chunk seen as rows of ``SKETCH_WIDTH`` is ``e[b, i] * s[p, i]``: ``e`` fresh per chunk, ``s``
per round, so a chunk costs one (rows x width) by (width x k) product and a few KB of randomness instead of a
k x chunk matrix. Each direction is +-1 everywhere, so a projection's square has the row's squared norm as its
mean; the product structure makes the estimate's tails heavier than for independent signs (worst for a row
that is an outer product in this layout), and checks size their bounds for that worst case (checks.py).
"""

from __future__ import annotations

import os

import blake3
import torch

from peerd.averaging.verify.keys import digest, u64

__all__ = ["SAMPLES", "SKETCH_SIZE", "SKETCH_WIDTH", "RoundRandomness", "commitment", "new_share", "span_seed"]

SHARE_BYTES = 32
# Coordinates per chunk. The spread check tells a lie from chance only when several samples land in it: a lie on
# 1-2% of a chunk meets 2.5-5 of 256 samples on average (of 64, 0.6-1.3); the values cost 1 KB per member
# and chunk.
SAMPLES = 256
SKETCH_SIZE = 16  # projections per chunk
SKETCH_WIDTH = 4096
_SHARE, _SEED = b"peerd.v1.averaging.seed-share", b"peerd.v1.averaging.seed"
_BITS = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)


def new_share() -> bytes:
    return os.urandom(SHARE_BYTES)


def commitment(share: bytes) -> bytes:
    return digest(_SHARE, share)


def span_seed(round_id: str, span: int, shares: dict[str, bytes]) -> bytes:
    """The seed of span ``span`` of round ``round_id`` from every member's share of it (member id -> share)."""
    return digest(_SEED, round_id, u64(span),
                  *(part for member in sorted(shares) for part in (member, shares[member])))


def _stream(seed: bytes, nbytes: int, *context: bytes | str) -> bytes:
    return bytes(blake3.blake3(digest(seed, *context)).digest(length=nbytes))


def _signs(data: bytes, rows: int, columns: int) -> torch.Tensor:
    """``rows x columns`` of +-1.0 from the bits of ``data``."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bits = (raw.unsqueeze(1) & _BITS).ne(0).reshape(-1)[: rows * columns]
    return bits.to(torch.float32).mul_(2).sub_(1).view(rows, columns)


class RoundRandomness:
    """What one seed draws; every member holding the seed draws the same."""

    def __init__(self, seed: bytes, chunk_numel: int) -> None:
        self.seed = seed
        self.chunk_numel = chunk_numel
        width = min(SKETCH_WIDTH, max(1, chunk_numel))
        self.s = _signs(_stream(seed, -(-width * SKETCH_SIZE // 8), b"sketch-s"), width, SKETCH_SIZE)

    def offsets(self, span: int, chunk: int, length: int) -> torch.Tensor:
        """The sampled coordinates of chunk ``chunk`` of span ``span`` (``length`` elements), int64."""
        if length <= 0:
            return torch.empty(0, dtype=torch.int64)
        raw = torch.frombuffer(bytearray(_stream(self.seed, 4 * SAMPLES, b"samples", u64(span), u64(chunk))),
                               dtype=torch.int32)
        return raw.to(torch.int64).remainder_(length)

    def sketch(self, span: int, chunk: int, row: torch.Tensor) -> torch.Tensor:
        """The ``SKETCH_SIZE`` projections of ``row`` (one chunk of a span), float64."""
        width = self.s.shape[0]
        length = row.numel()
        if length == 0:
            return torch.zeros(SKETCH_SIZE, dtype=torch.float64)
        blocks = -(-length // width)
        e = _signs(_stream(self.seed, -(-blocks * SKETCH_SIZE // 8), b"sketch-e", u64(span), u64(chunk)),
                   blocks, SKETCH_SIZE)
        full = length // width
        # the chunk as rows of `width` against s first: one (rows x width) by (width x k) product, then k sums
        # of `rows` terms (multiplying by e first leaves a k x width product to weigh by s)
        projected = torch.empty(blocks, SKETCH_SIZE)
        if full:
            torch.mm(row[: full * width].view(full, width), self.s, out=projected[:full])
        if length > full * width:
            tail = row[full * width :]
            torch.mv(self.s[: tail.numel()].t(), tail, out=projected[full])
        return (e.double() * projected.double()).sum(0)
