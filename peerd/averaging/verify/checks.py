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

A check that fails means the reducer's average is not its rule applied to the sealed rows, or a member misstated
its own row: only the rows can tell (disputes.py); this member applies nothing from the span either way. Two
rows counted as distinct that look alike (:func:`look_alike`) fail nothing, but the chunk is challenged.
"""

from __future__ import annotations

import functools
import math

import torch

from peerd.averaging.aggregation import (
    ROBUST_MIN_MEMBERS,
    cap_weights,
    clip_coefficients,
    equalized_coefficients,
)
from peerd.averaging.verify.energy import average_too_large, rows_too_far
from peerd.averaging.verify.payloads import (
    ENVELOPE_SLACK,
    FP16_ABSOLUTE,
    TINY,
    PayloadView,
    envelope,
    error_bound,
)
from peerd.averaging.verify.randomness import SKETCH_SIZE, RoundRandomness
from peerd.averaging.verify.samples import MemberSamples
from peerd.averaging.verify.statement import Chunk, Statement
from peerd.config import AveragingConfig

__all__ = ["SKETCH_TOLERANCE", "Inconsistent", "check_chunk", "check_medoid", "coefficients_of", "look_alike",
           "trimmed_at"]

COEFFICIENT_TOLERANCE = 1e-6
ACCUMULATION = 1e-5  # float32 sums of up to 64 rows, relative to the magnitudes summed
# A sketched squared distance over the true one: for rows whose difference is an outer product in the sketch's
# layout, the worst case, the ratio of 16 projections falls outside [0.019, 14.4] with probability 1e-6
# (estimated by sampling such rows); independent signs would give [0.09, 3.5].
SKETCH_LOW, SKETCH_HIGH = 0.015, 16.0
SKETCH_FLOAT = 1e-5
# the chance that honest rows' samples fail _check_spread, per pair of rows and chunk, whatever the rows hold
SPREAD_FALSE_ALARM = 1e-9
MEDOID_TOLERANCE = 1e-3
SKETCH_TOLERANCE = 1e-4  # how far a member's sketch may be from its row's, relative to the row's sketch norm
COPY_SKETCH = 2 * SKETCH_TOLERANCE  # identical rows' sketches: each may be that far from the row's


class Inconsistent(Exception):
    """The span's chunk ``chunk`` is not what its statement and the members' samples say."""

    def __init__(self, chunk: int, reason: str) -> None:
        super().__init__(f"chunk {chunk}: {reason}")
        self.chunk = chunk
        self.reason = reason


def coefficients_of(statement: Statement, chunk: Chunk, config: AveragingConfig) -> torch.Tensor | None:
    """The coefficients the statement's rule gives ``chunk``'s rows (None for trimmed_mean over 3 or more
    distinct rows), checked against the published ones; ValueError if the reducer's numbers do not follow from
    its rule."""
    weights = [statement.rows[r].weight for r in chunk.included]
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError("a row's weight is not finite and positive")
    distinct = chunk.distinct
    if statement.rule == "mean":
        if len(distinct) != len(weights):
            raise ValueError("the mean counts every row, copies included")
        expected = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    else:
        capped = cap_weights([weights[i] for i in distinct], config.max_weight_ratio)
        if len(distinct) < ROBUST_MIN_MEMBERS:
            if chunk.norms is None or not bool(chunk.norms.isfinite().all()) or bool((chunk.norms < 0).any()):
                raise ValueError(f"{len(distinct)} distinct rows without finite norms")
            within = equalized_coefficients(chunk.norms, capped)
        elif statement.rule == "trimmed_mean":
            return None
        else:
            if chunk.gram is None:
                raise ValueError("centered_clip without a Gram matrix")
            check_medoid(chunk.gram, chunk.medoid)
            within, _ = clip_coefficients(chunk.gram, capped, chunk.medoid, config.clip_radius,
                                          config.clip_iterations)
        expected = torch.zeros(len(weights), dtype=torch.float64)
        expected[distinct] = within  # a copy's coefficient is 0
    published = chunk.coefficients
    if published is None or (torch.tensor(published, dtype=torch.float64) - expected).abs().max() > \
            COEFFICIENT_TOLERANCE:
        raise ValueError(f"published coefficients {published} are not its rule's {expected.tolist()}")
    return expected


def _distances(gram: torch.Tensor) -> torch.Tensor:
    diagonal = gram.diagonal()
    return (diagonal[:, None] + diagonal[None, :] - 2 * gram).clamp_min(0)


def check_medoid(gram: torch.Tensor, medoid: int) -> None:
    if not bool(gram.isfinite().all()) or float((gram - gram.t()).abs().max()) > 1e-6 * float(
            gram.diagonal().abs().max() + 1e-300):
        raise ValueError("the Gram matrix is not a finite symmetric matrix")
    squared = _distances(gram)
    n = gram.shape[0]
    medians = [sorted(float(squared[i, j]) for j in range(n) if j != i)[(n - 2) // 2] for i in range(n)]
    scale = float(squared.max())
    if medians[medoid] > min(medians) * (1 + MEDOID_TOLERANCE) + 1e-12 * scale:
        raise ValueError(f"row {medoid} is not the medoid (median squared distance {medians[medoid]:.6g}, "
                         f"least {min(medians):.6g})")


def trimmed_at(values: torch.Tensor) -> torch.Tensor:
    """The trimmed mean of ``values`` (rows x samples) per column, as aggregation.trimmed_mean computes it."""
    n = values.shape[0]
    trim = math.ceil(n / 4)
    return values.sort(dim=0).values[trim : n - trim].mean(0)


def check_chunk(statement: Statement, index: int, samples: dict[int, MemberSamples], out: torch.Tensor,
                payload: PayloadView, randomness: RoundRandomness, config: AveragingConfig, required: int = 0) -> None:
    """Raises Inconsistent if chunk ``index`` of the span (``out``: the average this member decoded, ``payload``:
    its codec payload's view) does not agree with the statement and the included members' ``samples`` (by rank,
    each holding this span). ``required``: the elements this member's own included top-k row carried, which a
    SPARSE8 average must carry too unless it carries every nonzero element (payloads.error_bound)."""
    chunk = statement.chunks[index]
    try:
        coefficients = coefficients_of(statement, chunk, config)
    except ValueError as e:
        raise Inconsistent(index, str(e)) from None
    rows = [samples[r].spans[statement.span] for r in chunk.included]
    offsets = randomness.offsets(statement.span, index, out.numel())
    values = torch.stack([row.values[index] for row in rows])  # rows x samples, float64
    magnitude = values.abs().max(0).values
    if coefficients is None:
        expected = trimmed_at(values[chunk.distinct])
    else:
        expected = coefficients @ values
        magnitude = magnitude + coefficients.abs() @ values.abs()
    got = out[offsets].double()
    allowed = error_bound(payload, out, offsets, required) + ACCUMULATION * magnitude + TINY
    if bool((got - expected).abs().gt(allowed).any()):
        worst = int(((got - expected).abs() - allowed).argmax())
        raise Inconsistent(index, f"at element {int(offsets[worst])} the average is {float(got[worst]):.6g}, "
                                  f"the rule gives {float(expected[worst]):.6g}")
    envelopes = torch.stack([row.envelope[index] for row in rows])
    bound = envelopes.max(0).values if coefficients is None else coefficients.abs() @ envelopes
    own = envelope(payload, out, config.codec.block_size).double()
    if own.shape != bound.shape or bool(own.gt(bound * ENVELOPE_SLACK + FP16_ABSOLUTE).any()):
        raise Inconsistent(index, "the average exceeds what its rows' magnitudes allow in some block")
    norms = torch.stack([row.norms[index] for row in rows])
    block = average_too_large(out, payload, config.codec.block_size, norms if coefficients is not None else
                              norms[chunk.distinct], coefficients)
    if block is not None:
        raise Inconsistent(index, f"the average's norm in coarse block {block} exceeds what its rows' norms allow")
    if statement.rule == "mean":
        return
    sketches = [row.sketch[index] if row.sketch is not None else None for row in rows]
    if any(s is None for s in sketches):
        raise Inconsistent(index, f"{statement.rule}'s numbers cannot be checked: a row has no sketch")
    stacked = torch.stack([s for s in sketches if s is not None])
    _check_copies(chunk, index, statement.rule, values, stacked)
    distinct = stacked[chunk.distinct]
    if chunk.gram is not None and coefficients is not None:
        _check_gram(chunk.gram, index, distinct)
        _check_spread(chunk.gram, index, values[chunk.distinct], out.numel())
        if rows_too_far(norms[chunk.distinct], _distances(chunk.gram), chunk.gram.diagonal().abs()):
            raise Inconsistent(index, "the rows' block norms lie further apart than the published distances")
    if chunk.norms is not None:
        _check_norms(chunk.norms, index, distinct)
        _check_spread(chunk.norms, index, values[chunk.distinct], out.numel())
        if rows_too_far(norms[chunk.distinct], chunk.norms, chunk.norms.abs()):
            raise Inconsistent(index, "the rows' block norms exceed the published norms")


def _check_copies(chunk: Chunk, index: int, rule: str, values: torch.Tensor, sketches: torch.Tensor) -> None:
    """Rows declared copies hold the same values at the samples, exactly, and the same sketch up to float
    rounding (each member projects its own row); an honest row called a copy shows it at almost every sample."""
    for i, first in enumerate(chunk.same_as):
        if first == i:
            continue
        scale = float(sketches[first].norm()) + float(sketches[i].norm())
        if not torch.equal(values[i], values[first]) or float(
                (sketches[i] - sketches[first]).abs().max()) > COPY_SKETCH * scale + 1e-30:
            raise Inconsistent(index, f"{rule} counts row {i} as a copy of row {first}, and the rows differ")


def look_alike(statement: Statement, index: int, samples: dict[int, MemberSamples]) -> bool:
    """Whether two rows a robust rule counted as distinct in chunk ``index`` hold the same values at every sample
    and nearly the same sketch: copies the reducer left undeclared, or near-copies. Only the rows can tell, and
    near-copies must not stop an honest span, so the span is applied and the chunk audited (its dispute
    convicts a reducer whose rows are copies)."""
    chunk = statement.chunks[index]
    if statement.rule == "mean":
        return False
    seen: dict[bytes, torch.Tensor] = {}
    for i in chunk.distinct:
        row = samples[chunk.included[i]].spans[statement.span]
        if row.sketch is None:
            return False
        sketch, key = row.sketch[index], row.values[index].numpy().tobytes()
        if key in seen and float((sketch - seen[key]).abs().max()) <= COPY_SKETCH * float(
                sketch.norm() + seen[key].norm()) + 1e-30:
            return True
        seen.setdefault(key, sketch)
    return False


def _check_gram(gram: torch.Tensor, index: int, stacked: torch.Tensor) -> None:
    claimed = _distances(gram)
    sketched = ((stacked[:, None, :] - stacked[None, :, :]) ** 2).sum(-1) / SKETCH_SIZE
    norms = (stacked**2).sum(-1) / SKETCH_SIZE
    slack = SKETCH_FLOAT * (norms[:, None] + norms[None, :])
    if bool((sketched > SKETCH_HIGH * claimed + slack).any()) or bool((sketched < SKETCH_LOW * claimed - slack).any()):
        raise Inconsistent(index, "the published Gram matrix disagrees with the rows' sketched distances")


def _check_norms(claimed: torch.Tensor, index: int, stacked: torch.Tensor) -> None:
    """The published squared norms of the distinct rows against their sketches, within the bounds that hold the
    distances (a row's norm is its distance from zero)."""
    sketched = (stacked**2).sum(-1) / SKETCH_SIZE
    slack = SKETCH_FLOAT * sketched + 1e-300
    if bool((sketched > SKETCH_HIGH * claimed + slack).any()) or bool((sketched < SKETCH_LOW * claimed - slack).any()):
        raise Inconsistent(index, "the published norms disagree with the rows' sketched norms")


@functools.cache
def spread_bounds(samples: int, false_alarm: float = SPREAD_FALSE_ALARM) -> torch.Tensor:
    """Per rank r (1 to ``samples``): the t for which r or more uniform samples of a row land, by chance, where
    its squared elements exceed t times their mean. Fewer than 1/t of the elements can: a binomial tail, summed
    over the ranks, of at most ``false_alarm``, for any row."""
    k = torch.arange(samples + 1, dtype=torch.float64)
    log_choose = torch.lgamma(k.new_tensor(samples + 1.0)) - torch.lgamma(k + 1) - torch.lgamma(samples - k + 1)
    low = torch.zeros(samples, dtype=torch.float64)  # log t, bisected for every rank at once
    high = torch.full((samples,), 42.0, dtype=torch.float64)
    for _ in range(60):
        middle = (low + high) / 2
        p = torch.exp(-middle)[:, None]
        pmf = torch.exp(log_choose + k * torch.log(p) + (samples - k) * torch.log1p(-p))  # rank x count
        tails = pmf.flip(-1).cumsum(-1).flip(-1)[torch.arange(samples), torch.arange(1, samples + 1)]
        enough = tails <= false_alarm / samples
        high, low = torch.where(enough, middle, high), torch.where(enough, low, middle)
    return torch.exp(high)


def _check_spread(published: torch.Tensor, index: int, values: torch.Tensor, length: int) -> None:
    """The rows' samples (``values``, distinct rows x samples) against the squared distances between the rows
    (from ``published``, the Gram matrix around the medoid) or their squared norms (``published`` a vector) the
    coefficients followed from. A member's samples and sketch are both its own word: a member lying with its
    reducer (or a reducer about its own row) could sketch a row close to the others, so that the rule keeps it
    whole, and sample one far off, so that a wrong average matches the samples. Samples far off at many of
    the coordinates cannot come from a row that close (:func:`spread_bounds`)."""
    if published.dim() == 2:
        claimed = _distances(published)
        squared = (values[:, None, :] - values[None, :, :]) ** 2
        around = published.diagonal().abs()
        slack = SKETCH_FLOAT * (around[:, None] + around[None, :])
    else:
        claimed, squared = published, values**2
        slack = SKETCH_FLOAT * claimed.abs()
    if squared.shape[-1] == 0:
        return
    ordered = length * squared.sort(dim=-1, descending=True).values
    allowed = claimed[..., None] * spread_bounds(squared.shape[-1]) + slack[..., None] + 1e-300
    if bool((ordered > allowed).any()):
        raise Inconsistent(index, "the rows' samples lie further apart than the distances the coefficients "
                                  "follow from")
