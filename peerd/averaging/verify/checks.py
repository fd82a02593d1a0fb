"""A member's checks of one reducer's span, from the statement, every member's samples and its own average.

Per chunk that is not void:

1. **Coefficients.** The mean's follow from the sealed weights; centered_clip's from the published Gram matrix
   and medoid (recomputed here with the reducer's own code), whose medoid must be a medoid of that matrix and
   whose distances must agree with the members' sketches (a reducer understating how far its own row lies, or
   overstating the others', to escape clipping in its own span, is caught here); trimmed_mean has none. Under
   a robust rule, rows the statement calls copies of an earlier row get 0 and count once: their samples must
   equal that row's exactly and their sketches nearly (so a reducer cannot drop an honest row as a copy); with
   fewer than 3 distinct rows the coefficients follow from the published norms (each row scaled to the
   smallest), which must agree with the sketches as the distances do.
2. **Samples.** At the sampled coordinates the rule is recomputed from the members' values and compared with
   the average this member received, within the codec's bound read from the payload (payloads.py).
3. **Envelope.** Per coarse block the average's magnitude stays within the coefficients' combination of the
   rows' envelopes (the largest one for trimmed_mean).
4. **Spread.** Under centered_clip and the norm-equalized mean, the rows' samples lie no further apart than the
   distances (norms) the coefficients follow from allow: a row's sketch and samples are both its member's word,
   and one sketched close but sampled far off would keep its whole weight and still move the average.
5. **Energy.** Per coarse block the average's norm stays within what the rows' stated norms allow, and those
   norms lie no further apart than the published distances (energy.py): a lie on elements no sample hits
   shows in one or the other.

The chunks of a span are checked together, a batch of those that share their rows and size per operation (one
set of operations a span, not a chunk: a member checks every chunk of every span it gets). Only if a batch fails
are its chunks checked one by one, with the same operations, to name the first chunk that fails and why.

A check that fails means the reducer's average is not its rule applied to the sealed rows, or a member misstated
its own row: only the rows can tell (disputes.py); this member applies nothing from the span either way. Two
rows counted as distinct that look alike (:func:`look_alike`) fail nothing, but the chunk is challenged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peerd.averaging.verify import averages
from peerd.averaging.verify.coefficients import coefficients_of, distances, trimmed_at
from peerd.averaging.verify.energy import average_too_large, rows_too_far
from peerd.averaging.verify.payloads import ENVELOPE_SLACK, FP16_ABSOLUTE, TINY, PayloadView
from peerd.averaging.verify.randomness import RoundRandomness
from peerd.averaging.verify.samples import MemberSamples, SpanRows
from peerd.averaging.verify.sketches import copy_differs, gram_disagrees, norms_disagree, spread_too_wide
from peerd.averaging.verify.statement import Statement
from peerd.config import AveragingConfig

__all__ = ["Inconsistent", "check_chunk", "check_chunks"]

ACCUMULATION = 1e-5  # float32 sums of up to 64 rows, relative to the magnitudes summed


class Inconsistent(Exception):
    """The span's chunk ``chunk`` is not what its statement and the members' samples say."""

    def __init__(self, chunk: int, reason: str) -> None:
        super().__init__(f"chunk {chunk}: {reason}")
        self.chunk = chunk
        self.reason = reason


def check_chunks(statement: Statement, indices: Sequence[int], samples: dict[int, MemberSamples],
                 outs: Sequence[torch.Tensor], payloads: Sequence[PayloadView], randomness: RoundRandomness,
                 config: AveragingConfig, required: Sequence[int],
                 norms: Sequence[torch.Tensor | None] | None = None) -> None:
    """Raises Inconsistent for the first of the span's chunks ``indices`` (ascending) that does not agree with the
    statement and the included members' ``samples`` (by rank, each holding this span). Per chunk: ``outs``, the
    average this member decoded; ``payloads``, its codec payload's view; ``required``, the elements this member's
    own included top-k row carried, which a SPARSE8 average must carry too unless it carries every nonzero
    element (payloads.error_bound); ``norms``, the average's block norms if already taken (None: taken here)."""
    given = list(norms) if norms is not None else [None] * len(indices)
    batches: dict[tuple[object, ...], list[int]] = {}
    for position, index in enumerate(indices):
        chunk = statement.chunks[index]
        key = (tuple(chunk.included), tuple(chunk.same_as), chunk.gram is None, chunk.norms is None,
               outs[position].numel(), payloads[position].scheme, payloads[position].block)
        batches.setdefault(key, []).append(position)
    failed: list[int] = []
    for positions in batches.values():
        try:
            _check(statement, positions, indices, samples, outs, payloads, randomness, config, required, given)
        except Inconsistent:
            failed.extend(positions)
    for position in sorted(failed):  # one by one: the first chunk that fails, and its first failing check
        _check(statement, [position], indices, samples, outs, payloads, randomness, config, required, given)


def check_chunk(statement: Statement, index: int, samples: dict[int, MemberSamples], out: torch.Tensor,
                payload: PayloadView, randomness: RoundRandomness, config: AveragingConfig, required: int = 0) -> None:
    """:func:`check_chunks` of the one chunk ``index``."""
    check_chunks(statement, [index], samples, [out], [payload], randomness, config, [required])


def _stacked(rows: list[SpanRows], field: str, chunks: list[int]) -> torch.Tensor:
    """chunks x rows x ...: what each row states in ``field`` for each chunk."""
    return torch.stack([torch.stack([getattr(row, field)[i] for i in chunks]) for row in rows], dim=1)


def _check(statement: Statement, positions: list[int], indices: Sequence[int], samples: dict[int, MemberSamples],
           all_outs: Sequence[torch.Tensor], all_payloads: Sequence[PayloadView], randomness: RoundRandomness,
           config: AveragingConfig, all_required: Sequence[int], all_norms: Sequence[torch.Tensor | None]) -> None:
    """The checks of the chunks at ``positions`` of ``indices``, which share their rows, size and code; raises
    Inconsistent naming the batch's first chunk (its reason is exact for a batch of one)."""
    chunks = [indices[p] for p in positions]
    outs, payloads = [all_outs[p] for p in positions], [all_payloads[p] for p in positions]
    first = statement.chunks[chunks[0]]
    try:
        coefficients = coefficients_of(statement, [statement.chunks[index] for index in chunks], config)
    except ValueError as e:
        raise Inconsistent(chunks[0], str(e)) from None
    rows = [samples[r].spans[statement.span] for r in first.included]
    length, block_size = outs[0].numel(), config.codec.block_size
    offsets = torch.stack([randomness.offsets(statement.span, index, length) for index in chunks])
    values = _stacked(rows, "values", chunks)  # chunks x rows x samples, float64
    distinct = first.distinct
    magnitude = values.abs().amax(1)
    if coefficients is None:
        expected = trimmed_at(values[:, distinct])
    else:
        expected = (coefficients.unsqueeze(1) @ values).squeeze(1)
        magnitude = magnitude + (coefficients.abs().unsqueeze(1) @ values.abs()).squeeze(1)
    got = averages.sampled(outs, offsets)
    allowed = averages.error_bounds(payloads, outs, offsets, [all_required[p] for p in positions], block_size) + \
        ACCUMULATION * magnitude + TINY
    wrong = (got - expected).abs().gt(allowed)
    if bool(wrong.any()):
        at = int(wrong.any(1).nonzero()[0])
        worst = int(((got[at] - expected[at]).abs() - allowed[at]).argmax())
        raise Inconsistent(chunks[at], f"at element {int(offsets[at, worst])} the average is "
                                       f"{float(got[at, worst]):.6g}, the rule gives {float(expected[at, worst]):.6g}")
    bounds = _stacked(rows, "envelope", chunks)
    bound = bounds.amax(1) if coefficients is None else (coefficients.abs().unsqueeze(1) @ bounds).squeeze(1)
    own = averages.envelopes(payloads, outs, block_size)
    if own.shape != bound.shape or bool(own.gt(bound * ENVELOPE_SLACK + FP16_ABSOLUTE).any()):
        raise Inconsistent(chunks[0], "the average exceeds what its rows' magnitudes allow in some block")
    norms = _stacked(rows, "norms", chunks)
    taken = [norm for norm in (all_norms[p] for p in positions) if norm is not None]
    own_norms = torch.stack(taken) if len(taken) == len(positions) else averages.norms_of(outs, block_size)
    over = average_too_large(own_norms, averages.error_norms_of(payloads, outs, block_size),
                             norms if coefficients is not None else norms[:, distinct], coefficients)
    if over is not None:
        raise Inconsistent(chunks[over[0]], f"the average's norm in coarse block {over[1]} exceeds what its rows' "
                                            f"norms allow")
    if statement.rule == "mean":
        return
    if any(row.sketch is None for row in rows):
        raise Inconsistent(chunks[0], f"{statement.rule}'s numbers cannot be checked: a row has no sketch")
    sketches = _stacked(rows, "sketch", chunks)  # chunks x rows x SKETCH_SIZE
    if first.same_as != list(range(len(first.same_as))):
        for at, index in enumerate(chunks):
            copy = copy_differs(first, values[at], sketches[at])
            if copy is not None:
                raise Inconsistent(index, f"{statement.rule} counts row {copy} as a copy of row "
                                          f"{first.same_as[copy]}, and the rows differ")
    sketches, values, norms = sketches[:, distinct], values[:, distinct], norms[:, distinct]
    if first.gram is not None and coefficients is not None:
        gram = torch.stack([statement.chunks[index].gram for index in chunks])  # type: ignore[misc]
        if gram_disagrees(gram, sketches):
            raise Inconsistent(chunks[0], "the published Gram matrix disagrees with the rows' sketched distances")
        _spread(gram, values, length, chunks)
        if rows_too_far(norms, distances(gram), gram.diagonal(dim1=-2, dim2=-1).abs()):
            raise Inconsistent(chunks[0], "the rows' block norms lie further apart than the published distances")
    if first.norms is not None:
        claimed = torch.stack([statement.chunks[index].norms for index in chunks])  # type: ignore[misc]
        if norms_disagree(claimed, sketches):
            raise Inconsistent(chunks[0], "the published norms disagree with the rows' sketched norms")
        _spread(claimed, values, length, chunks)
        if rows_too_far(norms, claimed, claimed.abs()):
            raise Inconsistent(chunks[0], "the rows' block norms exceed the published norms")


def _spread(published: torch.Tensor, values: torch.Tensor, length: int, chunks: list[int]) -> None:
    if spread_too_wide(published, values, length):
        raise Inconsistent(chunks[0], "the rows' samples lie further apart than the distances the coefficients "
                                      "follow from")
