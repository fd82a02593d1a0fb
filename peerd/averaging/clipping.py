"""CenteredClip's coefficients from the Gram matrix of a chunk's rows: what a reducer computes for each chunk it
averages (aggregation.centered_clip), and what a member recomputes from a reducer's published matrices for every
chunk of every span it gets (verify/coefficients.py), a span's chunks at once. One implementation for both, on
numpy arrays: on a group's few rows numpy's small operations cost a fraction of torch's, and a batch of chunks
costs about what one does.
"""

from __future__ import annotations

import numpy
import torch

__all__ = ["OUTLIER_KEPT", "clip_batch", "clip_coefficients"]

# a member still clipped to under this fraction of its deviation at the end is left out, and the rest clipped again
OUTLIER_KEPT = 0.05


def clip_coefficients(gram: torch.Tensor, weights: list[float], medoid: int, radius: float,
                      iterations: int) -> tuple[torch.Tensor, list[float]]:
    """CenteredClip's result as coefficients of the rows (float64, summing to 1) and each row's kept fraction,
    from ``gram``, the Gram matrix of the rows minus row ``medoid``."""
    matrix = gram.detach().to(torch.float64).numpy()[None]
    coefficients, kept = clip_batch(matrix, numpy.asarray([weights], dtype=numpy.float64),
                                    numpy.asarray([medoid]), radius, iterations)
    return torch.from_numpy(coefficients[0]), [float(s) for s in kept[0]]


def clip_batch(grams: numpy.ndarray, weights: numpy.ndarray, medoids: numpy.ndarray, radius: float,
               iterations: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    """:func:`clip_coefficients` of a batch of chunks: ``grams`` (chunks x n x n), ``weights`` (chunks x n),
    ``medoids`` (chunks); coefficients and kept fractions, chunks x n each."""
    chunks, n = weights.shape
    with numpy.errstate(all="ignore"):  # a Gram matrix that overflowed float32: tau is not finite
        coefficients, scales, alone = _clip(grams, weights / weights.sum(1, keepdims=True), radius, iterations)
        outliers = scales < OUTLIER_KEPT
        count = outliers.sum(1)
        again = ~alone & (count > 0) & (count < n / 2)
        if again.any():
            w = numpy.where(outliers[again], 0.0, weights[again])
            second, rescaled, none = _clip(grams[again], w / w.sum(1, keepdims=True), radius, iterations)
            which = numpy.flatnonzero(again)[~none]
            coefficients[which] = second[~none]
            scales[which] = numpy.where(outliers[which], 0.0, rescaled[~none])
    rows = numpy.arange(chunks)
    # v = x_m + sum_j c_j (x_j - x_m): the medoid's coefficient is what the others leave
    others = coefficients.sum(1) - coefficients[rows, medoids]
    coefficients[rows, medoids] = 1.0 - others
    if alone.any():  # at least half the members equal the medoid: that is the answer
        coefficients[alone] = 0.0
        coefficients[rows[alone], medoids[alone]] = 1.0
        diagonal = numpy.diagonal(grams, axis1=1, axis2=2)
        scales[alone] = numpy.where(diagonal[alone] == 0.0, 1.0, 0.0)
    return coefficients, scales


def _clip(grams: numpy.ndarray, w: numpy.ndarray, radius: float,
          iterations: int) -> tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
    """The fixed-point iterations on the Gram matrices of differences from the medoid: per chunk the coefficients
    of the estimate, each member's last clip scale, and whether the members' median distance was 0 from the start
    (then the medoid is the answer, and the first two mean nothing)."""
    chunks, n = w.shape
    coefficients = numpy.zeros((chunks, n))
    scales = numpy.ones((chunks, n))
    diagonal = numpy.diagonal(grams, axis1=1, axis2=2)
    running = numpy.ones(chunks, dtype=bool)
    alone = numpy.zeros(chunks, dtype=bool)
    for iteration in range(iterations):
        # ||x_i - v||^2 = ||d_i - D^T c||^2 with d_i = x_i - x_m
        gc = numpy.matmul(grams, coefficients[:, :, None])[:, :, 0]
        squared = numpy.maximum(diagonal - 2 * gc + (coefficients * gc).sum(1, keepdims=True), 0.0)
        # tau follows the spread around the current estimate, not around the medoid: from the medoid, the
        # nearest member sets the scale, so in a group of 3 the other honest member is clipped in most rounds;
        # around the estimate every honest member sits near the median distance.
        # Members left out (weight 0) still count here: tau must not shrink because an outlier was dropped.
        tau = radius * numpy.sqrt(numpy.sort(squared, axis=1)[:, (n - 1) // 2])
        stopped = ~(tau > 0.0) | ~numpy.isfinite(tau)  # converged onto a member that half the group agrees with
        if iteration == 0:
            alone = stopped.copy()
        running &= ~stopped
        if not running.any():
            break
        clipped = numpy.minimum(tau[:, None] / numpy.maximum(numpy.sqrt(squared), 1e-300), 1.0)
        step = w * clipped  # v += sum_i w_i s_i (d_i - D^T c)
        moved = coefficients + step - step.sum(1, keepdims=True) * coefficients
        scales = numpy.where(running[:, None], clipped, scales)
        coefficients = numpy.where(running[:, None], moved, coefficients)
    return coefficients, scales, alone
