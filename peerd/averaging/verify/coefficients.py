"""The coefficients a reducer's rule gives a chunk's rows, recomputed from the numbers its statement publishes.

The mean's follow from the sealed weights; centered_clip's from the published Gram matrix and medoid (with the
reducer's own code, :mod:`peerd.averaging.clipping`), whose medoid must be a medoid of that
matrix; the norm-equalized mean's (fewer than 3 distinct rows) from the published norms; trimmed_mean has none.
A member does this for every chunk of every span it gets, and disputes (disputes.py) for the chunk they judge: on
a group's few rows numpy's small operations cost a fraction of torch's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy
import torch

from peerd.averaging.aggregation import ROBUST_MIN_MEMBERS, cap_weights, equalized_coefficients
from peerd.averaging.clipping import clip_batch
from peerd.averaging.verify.statement import Chunk, Statement
from peerd.config import AveragingConfig

__all__ = ["COEFFICIENT_TOLERANCE", "MEDOID_TOLERANCE", "check_medoid", "check_medoids", "coefficients_of", "distances",
           "trimmed_at"]

COEFFICIENT_TOLERANCE = 1e-6
MEDOID_TOLERANCE = 1e-3


def coefficients_of(statement: Statement, chunks: Sequence[Chunk], config: AveragingConfig) -> torch.Tensor | None:
    """The coefficients the statement's rule gives the rows of ``chunks`` (chunks x rows, float64; None for
    trimmed_mean over 3 or more distinct rows), checked against the published ones; ValueError if the reducer's
    numbers for some chunk do not follow from its rule. The chunks share their rows (included and copies)."""
    first = chunks[0]
    weights = [statement.rows[r].weight for r in first.included]
    if not weights:
        raise ValueError("an average of no rows")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError("a row's weight is not finite and positive")
    distinct = first.distinct
    expected = numpy.zeros((len(chunks), len(weights)))
    if statement.rule == "mean":
        if len(distinct) != len(weights):
            raise ValueError("the mean counts every row, copies included")
        expected[:] = numpy.asarray(weights, dtype=numpy.float64) / sum(weights)
    else:
        capped = cap_weights([weights[i] for i in distinct], config.max_weight_ratio)
        if len(distinct) < ROBUST_MIN_MEMBERS:
            if any(c.norms is None for c in chunks):
                raise ValueError(f"{len(distinct)} distinct rows without norms")
            norms = torch.stack([c.norms for c in chunks])  # type: ignore[misc]
            if not bool(norms.isfinite().all()) or bool((norms < 0).any()):
                raise ValueError(f"{len(distinct)} distinct rows without finite norms")
            within = equalized_coefficients(norms, capped).numpy()
        elif statement.rule == "trimmed_mean":
            return None
        else:
            if any(c.gram is None for c in chunks):
                raise ValueError("centered_clip without a Gram matrix")
            grams = torch.stack([c.gram for c in chunks]).numpy()  # type: ignore[misc]
            medoids = numpy.asarray([c.medoid for c in chunks])
            check_medoids(grams, medoids)
            within, _ = clip_batch(grams, numpy.broadcast_to(numpy.asarray(capped, dtype=numpy.float64),
                                                             (len(chunks), len(capped))).copy(),
                                   medoids, config.clip_radius, config.clip_iterations)
        expected[:, distinct] = within  # a copy's coefficient is 0
    if any(c.coefficients is None or len(c.coefficients) != len(weights) for c in chunks):
        raise ValueError(f"published coefficients {first.coefficients} are not its rule's")
    published = numpy.asarray([c.coefficients for c in chunks], dtype=numpy.float64)
    off = numpy.abs(published - expected).max(1)
    if not bool((off <= COEFFICIENT_TOLERANCE).all()):
        at = int(numpy.flatnonzero(~(off <= COEFFICIENT_TOLERANCE))[0])
        raise ValueError(f"published coefficients {chunks[at].coefficients} are not its rule's "
                         f"{expected[at].tolist()}")
    return torch.from_numpy(expected)


def distances(gram: torch.Tensor) -> torch.Tensor:
    """The squared distances between the rows (``gram``: their Gram matrix, or that of the rows minus any one
    row; leading dimensions are batches of chunks)."""
    diagonal = gram.diagonal(dim1=-2, dim2=-1)
    return (diagonal[..., :, None] + diagonal[..., None, :] - 2 * gram).clamp_min(0)


def check_medoid(gram: torch.Tensor, medoid: int) -> None:
    """ValueError unless ``gram`` (k x k, float64) is a finite symmetric matrix whose row ``medoid`` has the least
    median squared distance to the others, within ``MEDOID_TOLERANCE``."""
    check_medoids(gram.detach().to(torch.float64).numpy()[None], numpy.asarray([medoid]))


def check_medoids(grams: numpy.ndarray, medoids: numpy.ndarray) -> None:
    """:func:`check_medoid` of a batch of chunks: ``grams`` chunks x k x k, ``medoids`` chunks."""
    diagonal = numpy.diagonal(grams, axis1=1, axis2=2)
    with numpy.errstate(all="ignore"):  # a non-finite matrix fails below, whatever its arithmetic gives
        finite = numpy.isfinite(grams).all(axis=(1, 2))
        if not bool(finite.all()) or bool((numpy.abs(grams - grams.transpose(0, 2, 1)).max(axis=(1, 2)) > 1e-6 * (
                numpy.abs(diagonal).max(1) + 1e-300)).any()):
            raise ValueError("the Gram matrix is not a finite symmetric matrix")
    squared = numpy.maximum(diagonal[:, :, None] + diagonal[:, None, :] - 2 * grams, 0.0)
    n = grams.shape[1]
    others = squared.copy()
    others[:, numpy.arange(n), numpy.arange(n)] = numpy.inf  # sorted last: the (n - 2) // 2-th of the others
    medians = numpy.sort(others, axis=2)[:, :, (n - 2) // 2]
    least = medians.min(1)
    at = medians[numpy.arange(len(medoids)), medoids]
    wrong = at > least * (1 + MEDOID_TOLERANCE) + 1e-12 * squared.max(axis=(1, 2))
    if bool(wrong.any()):
        c = int(numpy.flatnonzero(wrong)[0])
        raise ValueError(f"row {int(medoids[c])} is not the medoid (median squared distance {float(at[c]):.6g}, "
                         f"least {float(least[c]):.6g})")


def trimmed_at(values: torch.Tensor) -> torch.Tensor:
    """The trimmed mean of ``values`` (rows x samples, with any leading batch dimensions) per column, as
    aggregation.trimmed_mean computes it."""
    n = values.shape[-2]
    trim = math.ceil(n / 4)
    return values.sort(dim=-2).values[..., trim : n - trim, :].mean(-2)
