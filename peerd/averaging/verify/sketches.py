"""The robust rules' numbers against what the members say of their rows: sketched distances and norms, the spread
of the samples, and copies. Every function takes a batch of chunks of one span that share their rows' layout
(leading dimension: the chunk) and says whether something disagrees; checks.py names the chunk.
"""

from __future__ import annotations

import functools

import torch

from peerd.averaging.verify.coefficients import distances
from peerd.averaging.verify.randomness import SKETCH_SIZE
from peerd.averaging.verify.samples import MemberSamples
from peerd.averaging.verify.statement import Chunk, Statement

__all__ = ["COPY_SKETCH", "SKETCH_HIGH", "SKETCH_LOW", "SKETCH_TOLERANCE", "copy_differs", "gram_disagrees",
           "look_alike", "norms_disagree", "spread_bounds", "spread_too_wide"]

# A sketched squared distance over the true one: for rows whose difference is an outer product in the sketch's
# layout, the worst case, the ratio of 16 projections falls outside [0.019, 14.4] with probability 1e-6
# (estimated by sampling such rows); independent signs would give [0.09, 3.5].
SKETCH_LOW, SKETCH_HIGH = 0.015, 16.0
SKETCH_FLOAT = 1e-5
# the chance that honest rows' samples fail spread_too_wide, per pair of rows and chunk, whatever the rows hold
SPREAD_FALSE_ALARM = 1e-9
SKETCH_TOLERANCE = 1e-4  # how far a member's sketch may be from its row's, relative to the row's sketch norm
COPY_SKETCH = 2 * SKETCH_TOLERANCE  # identical rows' sketches: each may be that far from the row's


def gram_disagrees(gram: torch.Tensor, sketches: torch.Tensor) -> bool:
    """Whether the published Gram matrices (chunks x k x k) disagree with the distinct rows' sketched distances
    (``sketches``: chunks x k x SKETCH_SIZE)."""
    claimed = distances(gram)
    sketched = ((sketches[:, :, None, :] - sketches[:, None, :, :]) ** 2).sum(-1) / SKETCH_SIZE
    norms = (sketches**2).sum(-1) / SKETCH_SIZE
    slack = SKETCH_FLOAT * (norms[:, :, None] + norms[:, None, :])
    return bool((sketched > SKETCH_HIGH * claimed + slack).any()) or bool(
        (sketched < SKETCH_LOW * claimed - slack).any())


def norms_disagree(claimed: torch.Tensor, sketches: torch.Tensor) -> bool:
    """Whether the published squared norms of the distinct rows (chunks x k) disagree with their sketches, within
    the bounds that hold the distances (a row's norm is its distance from zero)."""
    sketched = (sketches**2).sum(-1) / SKETCH_SIZE
    slack = SKETCH_FLOAT * sketched + 1e-300
    return bool((sketched > SKETCH_HIGH * claimed + slack).any()) or bool(
        (sketched < SKETCH_LOW * claimed - slack).any())


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


def spread_too_wide(published: torch.Tensor, values: torch.Tensor, length: int) -> bool:
    """Whether the rows' samples (``values``: chunks x distinct rows x samples) lie further apart than the
    squared distances between the rows (``published`` chunks x k x k: the Gram matrix around the medoid) or
    their squared norms (``published`` chunks x k) the coefficients followed from; ``length``: each chunk's
    elements. A member's samples and sketch are both its own word: a member lying with its reducer (or a
    reducer about its own row) could sketch a row close to the others, so that the rule keeps it whole, and
    sample one far off, so that a wrong average matches the samples. Samples far off at many of the
    coordinates cannot come from a row that close (:func:`spread_bounds`)."""
    if published.dim() == 3:  # each pair once, held to the smaller of its two published distances
        first, second = torch.triu_indices(values.shape[1], values.shape[1], 1)
        full = distances(published)
        claimed = torch.minimum(full[:, first, second], full[:, second, first])
        squared = (values[:, first, :] - values[:, second, :]) ** 2
        around = published.diagonal(dim1=-2, dim2=-1).abs()
        slack = SKETCH_FLOAT * (around[:, first] + around[:, second])
    else:
        claimed, squared = published, values**2
        slack = SKETCH_FLOAT * claimed.abs()
    if squared.shape[-1] == 0:
        return False
    ordered = length * squared.sort(dim=-1, descending=True).values
    allowed = claimed[..., None] * spread_bounds(squared.shape[-1]) + slack[..., None] + 1e-300
    return bool((ordered > allowed).any())


def copy_differs(chunk: Chunk, values: torch.Tensor, sketches: torch.Tensor) -> int | None:
    """The first row ``chunk`` declares a copy of an earlier row that differs from it (``values``: rows x
    samples, ``sketches``: rows x SKETCH_SIZE, of this chunk), or None. Copies hold the same values at the
    samples, exactly, and the same sketch up to float rounding (each member projects its own row); an honest
    row called a copy shows it at almost every sample."""
    for i, first in enumerate(chunk.same_as):
        if first == i:
            continue
        scale = float(sketches[first].norm()) + float(sketches[i].norm())
        if not torch.equal(values[i], values[first]) or float(
                (sketches[i] - sketches[first]).abs().max()) > COPY_SKETCH * scale + 1e-30:
            return i
    return None


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
