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

Only averages coded exactly, in fp16, in 8-bit blocks or as SPARSE8 (the largest elements at 8 bits) have a
bound (:func:`bounded`). The narrower schemes (4 and 2 bits, top-k) work only with error feedback carrying most
of what a round drops into the next, so an honest reducer's average coded that way may be far from its exact
one, by a residual nobody else holds: no member can tell it from a lie. So a reducer whose members send narrow
codes returns its average in a checkable code (:func:`average_code`) unless
``averaging.verification.check_narrow_codes`` is off; then members apply such averages unchecked, and only if
they code that way themselves (``round.RoundVerification``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peerd.config import CodecConfig
from peerd.wire import codec, topk
from peerd.wire.codec import HEADER, MIN_SCALE, TOPK_BITS, Scheme
from peerd.wire.feedback import encode_with_feedback

__all__ = ["COARSE_BLOCKS", "PayloadView", "average_code", "average_count", "block_norms", "bounded",
           "checks_averages", "clamp_residual", "code_average", "envelope", "error_bound", "error_norms", "scheme_of",
           "sent_count", "view"]

COARSE_BLOCKS = 32
ERROR_SLACK = 1.01  # |average - exact| <= 1.002 scales with the clamped residual; bf16 scales round up
FP16_RELATIVE, FP16_ABSOLUTE = 2.0**-10, 2.0**-23  # twice fp16's rounding (its chunks carry no residual)
ENVELOPE_SLACK = 1.02  # a coded value exceeds the exact one by its rounded-up scale and the clamped residual
TINY = 127 * 4 * MIN_SCALE


@dataclass(frozen=True)
class PayloadView:
    scheme: Scheme
    numel: int
    block: int  # INT8 block size (SPARSE8: sent values per scale); 0 otherwise
    scales: torch.Tensor | None  # INT8: one float32 scale per block
    support: torch.Tensor | None = None  # SPARSE8: the sorted positions it carries (every other element is 0)
    support_scales: torch.Tensor | None = None  # SPARSE8: one float32 scale per block of sent values


def view(payload: bytes | bytearray) -> PayloadView:
    """The scheme and scales of a payload that already decoded without error (so its layout is valid)."""
    _, _, code, _, ndim, block, _, numel = HEADER.unpack_from(payload)
    head = HEADER.size + 8 * ndim
    scheme = Scheme(code)
    if scheme is Scheme.SPARSE8:
        positions, scales = topk.support(memoryview(payload)[head:], numel, block, TOPK_BITS[scheme])
        return PayloadView(scheme, numel, block, None, positions, scales)
    if scheme is not Scheme.INT8_BLOCKWISE:
        return PayloadView(scheme, numel, 0, None)
    nblocks = -(-numel // block)
    raw = torch.frombuffer(bytearray(payload[head : head + 2 * nblocks]), dtype=torch.bfloat16)
    return PayloadView(Scheme.INT8_BLOCKWISE, numel, block, raw.float())


def scheme_of(payload: bytes | bytearray) -> Scheme:
    """The scheme of a payload that already decoded without error."""
    return Scheme(HEADER.unpack_from(payload)[2])


def sent_count(payload: bytes | bytearray) -> int:
    """The elements a payload that already decoded without error carries by position (its ``k``: schemes with
    the top-k layout), or 0 for the others."""
    _, _, code, _, ndim, _, _, _ = HEADER.unpack_from(payload)
    return (topk.read_k(memoryview(payload)[HEADER.size + 8 * ndim :]) or 0) if code in TOPK_BITS else 0


def bounded(payload: PayloadView) -> bool:
    """Whether an honest reducer's average coded as ``payload`` is within a known bound of its exact one."""
    return payload.scheme in (Scheme.RAW, Scheme.FP16, Scheme.INT8_BLOCKWISE, Scheme.SPARSE8)


def checks_averages(config: CodecConfig, check_narrow_codes: bool) -> bool:
    """Whether a peer coding with ``config`` codes every average it reduces within a bound (:func:`bounded`),
    and so checks every average it applies: exact or 8-bit codes, or narrower ones whose averages return in a
    checkable code (``averaging.verification.check_narrow_codes``)."""
    return config.lossless or config.scheme == "blockwise8" or check_narrow_codes


def average_code(config: CodecConfig, check_narrow_codes: bool) -> tuple[CodecConfig, bool]:
    """How a reducer whose members code with ``config`` codes the averages it returns: ``(config, largest)``.
    ``largest``: as SPARSE8, the largest elements of an average of top-k rows at 8 bits (the returned config
    then serves chunks below its ``min_compress_numel``). Under ``check_narrow_codes``, averages of 4- and
    2-bit rows return in 8-bit blocks and those of top-k rows as SPARSE8, without the reducer's residual."""
    if config.lossless or config.scheme == "blockwise8" or not check_narrow_codes:
        return config, False
    return config.model_copy(update={"scheme": "blockwise8"}), config.scheme == "topk"


def average_count(config: CodecConfig, numel: int, rows: int) -> int:
    """How many elements a reducer coding with ``config`` carries of a SPARSE8 average of ``numel`` elements
    whose top-k rows carry at most ``rows`` each: at least what its own rows and every member's carry, so that
    every member's check (:func:`error_bound`) holds."""
    return max(rows, topk.choose_k(numel, config.density))


def code_average(average: torch.Tensor, residual: torch.Tensor | None, config: CodecConfig, check_narrow_codes: bool,
                 peer_id: str, rows: int = 0) -> bytearray:
    """A reducer's payload of one chunk's ``average`` (members coding with ``config``), which is replaced by
    what every member decodes of it, so that the reducer applies bit-identical values. ``residual``: what
    coding dropped from this peer's last average of these elements, added to this one where the code needs it
    (kept within half a step of it where members check the average: :func:`clamp_residual`; dropped for
    SPARSE8, whose members carry what it leaves out instead). ``rows``: the most elements a member's top-k row of
    the chunk carries (:func:`average_count`)."""
    average_config, largest = average_code(config, check_narrow_codes)
    coded = not average_config.lossless and average.numel() >= max(average_config.min_compress_numel, 1)
    if coded and largest:  # the largest elements, no residual (left untouched: it stays unmapped memory)
        payload = codec.encode_largest(average, average_config.block_size,
                                       average_count(config, average.numel(), rows))
        codec.decode(payload, peer_id=peer_id, expected_shape=tuple(average.shape), out=average)
        return payload
    if residual is not None and checks_averages(config, check_narrow_codes):
        clamp_residual(average, residual, average_config.block_size, coded)
    payload, _ = encode_with_feedback(average, average_config, peer_id, carried=residual, dropped=residual,
                                      decoded=average)
    return payload


def error_bound(payload: PayloadView, decoded: torch.Tensor, index: torch.Tensor | None,
                required: int = 0) -> torch.Tensor:
    """For the elements ``index`` (None: every one) of a reducer's coded average (``decoded``): how far an honest
    reducer's coded value may be from its exact average, float64. ``required``: the most elements a member's
    top-k row of the chunk carries (SPARSE8 carries at least as many, or every nonzero element)."""
    if payload.scales is not None:
        scales = payload.scales.repeat_interleave(payload.block)[: decoded.numel()] if index is None else \
            payload.scales[index // payload.block]
        return scales.double() * ERROR_SLACK + TINY
    if index is None:
        index = torch.arange(decoded.numel())
    if payload.support is not None and payload.support_scales is not None:
        # a sent element: the step of its block of sent values, as for 8-bit blocks (rounding takes half of it;
        # SPARSE8 carries no residual). Any other element: 0 if fewer than `required` were sent (an honest
        # reducer then sent every nonzero one), else at most the smallest sent one, whose exact value is within
        # a step of what it decodes to.
        bound = torch.zeros(index.numel(), dtype=torch.float64)
        count = payload.support.numel()
        if count:
            steps = payload.support_scales[torch.arange(count) // payload.block].double() * ERROR_SLACK
            at = torch.searchsorted(payload.support, index).clamp_(max=count - 1)
            sent = payload.support[at] == index
            if count >= required:
                bound.fill_(float((decoded[payload.support].double().abs() + steps).min()))
            bound[sent] = steps[at[sent]]
        return bound + TINY
    if payload.scheme is Scheme.FP16:
        return decoded[index].double().abs() * FP16_RELATIVE + FP16_ABSOLUTE
    return torch.zeros(index.numel(), dtype=torch.float64)


def error_norms(payload: PayloadView, decoded: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per coarse block of a reducer's coded average (``decoded``): the L2 norm of how far an honest reducer's
    nonzero coded values may be from its exact average there (:func:`error_bound` over the block, float64). An
    element coded as 0 adds nothing to the coded block's norm, so its error is left out."""
    coarse = COARSE_BLOCKS * block_size
    blocks = -(-decoded.numel() // coarse)
    squared = torch.zeros(blocks, dtype=torch.float64)
    if payload.scales is not None:  # every element of a codec block within its scale: per codec block, not element
        starts = torch.arange(payload.scales.numel(), dtype=torch.int64) * payload.block
        counts = (decoded.numel() - starts).clamp_(max=payload.block).double()
        per_block = (payload.scales.double() * ERROR_SLACK + TINY) ** 2 * counts
        squared.scatter_add_(0, starts // coarse, per_block)  # a codec block across two coarse ones: in both
        last = (starts + counts.long() - 1) // coarse
        across = last != starts // coarse
        squared.scatter_add_(0, last[across], per_block[across])
    elif payload.support is not None and payload.support_scales is not None:
        count = payload.support.numel()
        steps = payload.support_scales[torch.arange(count) // payload.block].double() * ERROR_SLACK + TINY
        squared.scatter_add_(0, payload.support // coarse, steps**2)
    elif payload.scheme is Scheme.FP16:
        own = block_norms(decoded, block_size)
        lengths = torch.full((blocks,), float(coarse), dtype=torch.float64)
        if blocks:
            lengths[-1] = decoded.numel() - (blocks - 1) * coarse
        return own * FP16_RELATIVE + lengths.sqrt() * FP16_ABSOLUTE
    return squared.sqrt_()


def envelope(payload: PayloadView | None, decoded: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per coarse block of ``COARSE_BLOCKS * block_size`` elements: an upper bound on |value| (float32).
    From the scales when the payload's blocks are the configured ones, else from the values (SPARSE8: each less
    what coding may have added to it, so a bound on the exact values the average codes)."""
    coarse = COARSE_BLOCKS * block_size
    blocks = -(-decoded.numel() // coarse)
    if payload is not None and payload.scales is not None and payload.block == block_size:
        scales = payload.scales
        padded = torch.zeros(blocks * COARSE_BLOCKS)
        padded[: scales.numel()] = scales
        return padded.view(blocks, COARSE_BLOCKS).amax(1).mul_(127.0)
    if payload is not None and payload.support is not None and payload.support_scales is not None:
        # SPARSE8: a block of sent values spans coarse blocks, and rounding by its step can lift a small element
        # above its own coarse block's exact bound; |decoded| less half that step is at most the exact value
        bound = torch.zeros(blocks)
        if payload.support.numel():
            half_step = payload.support_scales[torch.arange(payload.support.numel()) // payload.block] * 0.5
            sent = (decoded[payload.support].float().abs() - half_step * ERROR_SLACK).clamp_(min=0)
            bound.scatter_reduce_(0, payload.support // coarse, sent, reduce="amax")
        return bound
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


def block_norms(decoded: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per coarse block of ``COARSE_BLOCKS * block_size`` elements: the L2 norm of ``decoded`` there (float64).
    A row's energy per block: it bounds the average's there (a convex combination of the rows), and the row's
    distances to the others from below (two rows' norms in a block differ by no more than the rows do there)."""
    coarse = COARSE_BLOCKS * block_size
    full = decoded.numel() // coarse
    norms = torch.zeros(-(-decoded.numel() // coarse), dtype=torch.float64)
    rows = decoded[: full * coarse].view(full, coarse)
    if full:  # in float32, 8x faster than in float64, within ~1e-7 of it
        norms[:full] = torch.linalg.vector_norm(rows, dim=1)
    if norms.numel() > full:
        norms[full] = torch.linalg.vector_norm(decoded[full * coarse :], dtype=torch.float64)
    # float32 squares overflow past ~1e19 and lose precision below ~1e-19: those blocks again in float64
    odd = (~norms[:full].isfinite() | (norms[:full] < 1e-15)).nonzero().flatten()
    if odd.numel():
        norms[odd] = torch.linalg.vector_norm(rows[odd], dim=1, dtype=torch.float64)
    return norms


def clamp_residual(average: torch.Tensor, residual: torch.Tensor, block_size: int, int8: bool) -> None:
    """Keeps a reducer's carried residual within half a codec step of ``average`` in every block (``int8``: the
    chunk is coded blockwise), or drops it for chunks sent as they are."""
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
