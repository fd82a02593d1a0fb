"""Aggregation rules a reducer applies to one chunk of its span: the weighted mean and the robust rules.

A robust rule sees every included member's decoded chunk at once, as rows of a (members, numel) matrix in
rank order, so its result does not depend on arrival order. Two defences act together:

- Claimed weights are capped at ``max_weight_ratio`` times the group's median claim (the lower median, so
  with two members the smaller claim sets the cap): a member claiming 10x the samples of the others gets at
  most ``max_weight_ratio`` times their say.
- ``centered_clip`` (Karimireddy et al. 2021, as used per partition in "Secure Distributed Training at
  Scale", Gorbunov et al. 2022): start at the medoid (the member with the smallest median distance to the
  others), then repeat ``v += sum_i w_i * clip_tau(x_i - v) / sum_i w_i``, where ``clip_tau`` scales a
  vector down to norm ``tau``. ``tau`` is ``clip_radius`` times the (lower) median distance of the members
  from the current ``v``, recomputed every iteration, so it follows the honest members' spread with no
  scale to tune: a majority of honest members is within it, a member far outside it is clipped. A member's "kept" fraction is the scale its
  deviation got in the last iteration (1: untouched).
- ``trimmed_mean``: per coordinate, drop the ``ceil(n / 4)`` smallest and largest values, average the rest
  (unweighted: any weighting would let a heavy claim back in).

Two degenerate cases would hand the result to one side, so robust rules treat them first:

- Identical rows. Members' gradients from different data never coincide exactly; identical rows are copies
  (sybils of one attacker). Not so in state averaging, whose honest members hold bit-identical parameters:
  there (``agreeing``) identical rows are members that agree, and a majority of them is the result. Half a group's rows identical make CenteredClip's radius 0 (the median distance
  from them), and their row wins outright. Each set of identical rows counts as one member, with one weight:
  the copies are reported as left out (kept 0).
- Fewer than 3 distinct rows (a group of 2): there is no majority to trust. Each row is scaled down to the
  smaller norm of the two before the mean of the capped weights, so neither side can outweigh the other: a
  member sending -1000x its gradient can cancel its partner's step, not reverse or blow it up. Callers
  report the rule used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from peerd.averaging.clipping import clip_coefficients

ROBUST_MIN_MEMBERS = 3


@dataclass(frozen=True)
class Combined:
    """What one rule did to one chunk: ``kept[i]`` is member row i's kept fraction (1.0 if untouched),
    ``weights[i]`` the weight it was given after capping. A rule whose result is a weighted sum of the rows
    says with which ``coefficients`` (what a reducer publishes so members can check its average). Where they
    follow from numbers only the reducer holds, it gives those too, for the distinct rows (all rows but copies):
    centered_clip its ``medoid`` (a position among them) and the ``gram`` matrix of those rows minus the
    medoid's (:func:`peerd.averaging.clipping.clip_coefficients`); the norm-equalized mean their squared ``norms``
    (:func:`equalized_coefficients`). ``same_as[i]``: the first row identical to row i (i if none), None when
    every row is distinct; a copy's coefficient is 0."""

    kept: list[float]
    weights: list[float]
    coefficients: list[float] | None = None
    medoid: int = 0
    gram: torch.Tensor | None = None
    norms: torch.Tensor | None = None
    same_as: list[int] | None = None


def cap_weights(claims: list[float], max_ratio: float) -> list[float]:
    """Each claim capped at ``max_ratio`` times the lower median claim."""
    ordered = sorted(claims)
    cap = max_ratio * ordered[(len(ordered) - 1) // 2]
    return [min(claim, cap) for claim in claims]


def weighted_mean(rows: torch.Tensor, weights: list[float], out: torch.Tensor) -> Combined:
    w = torch.tensor(weights, dtype=torch.float64)
    torch.mv(rows.t(), (w / w.sum()).to(rows.dtype), out=out)
    return Combined([1.0] * len(weights), weights, (w / w.sum()).tolist())


def medoid_of(gram: torch.Tensor) -> int:
    """The member whose median distance to the others is smallest (``gram``: the Gram matrix of the rows, or
    of the rows minus any one row): an honest member while most are."""
    norms = gram.diagonal()
    distances = (norms[:, None] + norms[None, :] - 2 * gram).clamp_min(0).sqrt()
    n = gram.shape[0]
    others = [sorted(float(d) for j, d in enumerate(distances[i]) if j != i) for i in range(n)]
    medians = [row[(len(row) - 1) // 2] for row in others]
    return min(range(n), key=lambda i: (medians[i], i))


def around(gram: torch.Tensor, medoid: int) -> torch.Tensor:
    """The Gram matrix of the rows minus row ``medoid``, from that of the rows minus any one row (float64)."""
    centered = gram - gram[:, medoid : medoid + 1] - gram[medoid : medoid + 1, :] + gram[medoid, medoid]
    # exactly symmetric, as members check the published matrix: float32's product of 5 to 7 rows of a chunk is not
    # (up to 6e-6 of the diagonal apart), and the line above rounds the two sides in different orders
    centered = (centered + centered.t()) / 2
    centered[medoid, :] = 0.0  # exactly: x_m - x_m is 0, whatever the rounding of the line above
    centered[:, medoid] = 0.0
    return centered


BASE_SAMPLE = 4096


def differences(rows: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Turns ``rows`` (members x numel, overwritten) into their differences from a base row, which ``base``
    receives, and returns the Gram matrix of those differences (float64). Differences, not raw rows: members
    close to each other keep their distances' precision (from raw rows float32 loses the distances of rows that
    differ by less than ~1e-3 of their norm, parameters for one). The base is a medoid of at most
    ``BASE_SAMPLE`` evenly spaced columns of the rows minus row 0, not row 0 itself: from a far row 0 (an
    outlier's) float32 would lose the other members' distances just the same. A member judging a dispute
    recomputes it from the same rows with the same operations."""
    sample = rows[:, :: max(1, rows.shape[1] // BASE_SAMPLE)]
    first = sample - sample[0]
    base.copy_(rows[medoid_of((first @ first.t()).double())])
    rows.sub_(base)
    return (rows @ rows.t()).double()


def centered_clip(
    rows: torch.Tensor, weights: list[float], out: torch.Tensor, radius: float, iterations: int
) -> Combined:
    """Writes the CenteredClip aggregate of ``rows`` (members x numel; overwritten) into ``out``.

    The iterate stays in the span of the rows, ``v = x_m + sum_j c_j (x_j - x_m)`` around the medoid ``x_m``,
    so every distance comes from one members x members Gram matrix (:func:`differences`) and the chunk is
    touched a few times however many iterations run.

    A member still clipped to under ``clipping.OUTLIER_KEPT`` of its deviation at the end (over 40 median deviations
    away at the default radius; honest LM gradients kept >= 0.9) is left out and the rest are clipped again:
    clipping alone still lets it pull by the radius times its weight share, every round.
    """
    based = differences(rows, out)
    medoid = medoid_of(based)
    gram = around(based, medoid)
    coefficients, kept = clip_coefficients(gram, weights, medoid, radius, iterations)
    # v = x_b + sum_j a_j (x_j - x_b) for the base row x_b in `out`, the coefficients summing to 1
    out.add_(torch.mv(rows.t(), coefficients.to(rows.dtype)))
    return Combined(kept, weights, coefficients.tolist(), medoid, gram)


def trimmed_mean(rows: torch.Tensor, weights: list[float], out: torch.Tensor) -> Combined:
    """Writes the coordinate-wise trimmed mean of ``rows`` into ``out``; ``kept[i]`` is the fraction of
    member i's coordinates that entered the mean. ``weights`` are only reported: the mean is unweighted."""
    n = rows.shape[0]
    trim = math.ceil(n / 4)
    ordered, order = torch.sort(rows, dim=0)
    torch.mean(ordered[trim : n - trim], dim=0, out=out)
    middle = order[trim : n - trim].reshape(-1)
    kept_counts = torch.bincount(middle, minlength=n)
    numel = max(1, rows.shape[1])
    return Combined([float(c) / numel for c in kept_counts], weights)


def equalized_coefficients(squared_norms: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """The coefficients of the capped-weight mean of rows each scaled down to the smallest row norm (float64):
    what :func:`equalized_mean` applies, and what a member recomputes from a reducer's published norms."""
    w = torch.tensor(weights, dtype=torch.float64)
    return _scales(squared_norms) * w / w.sum()


def _scales(squared_norms: torch.Tensor) -> torch.Tensor:
    norms = squared_norms.clamp_min(0).sqrt()
    return torch.clamp(norms.amin(-1, keepdim=True) / norms.clamp_min(1e-300), max=1.0)  # per chunk of a batch


def equalized_mean(rows: torch.Tensor, weights: list[float], out: torch.Tensor, gram: torch.Tensor) -> Combined:
    """The weighted mean of ``rows`` each scaled down to the smallest row norm (``gram``: their Gram matrix)."""
    norms = gram.diagonal().clone()
    coefficients = equalized_coefficients(norms, weights)
    torch.mv(rows.t(), coefficients.to(rows.dtype), out=out)
    return Combined([float(s) for s in _scales(norms)], weights, coefficients.tolist(), norms=norms)


def distinct(rows: torch.Tensor) -> list[int]:
    """Per row, the index of the first row identical to it (its own index if none: a distinct row). Identical
    means ``torch.equal``: exactly, so whoever holds the rows finds the same copies. Only rows that agree at
    ``BASE_SAMPLE`` evenly spaced columns are compared in full (members' gradients differ almost everywhere)."""
    sample = rows[:, :: max(1, rows.shape[1] // BASE_SAMPLE)]
    first: list[int] = []
    for i in range(rows.shape[0]):
        first.append(next((j for j in range(i) if first[j] == j and torch.equal(sample[i], sample[j])
                           and torch.equal(rows[i], rows[j])), i))
    return first


def combine(
    rule: str, rows: torch.Tensor, claims: list[float], out: torch.Tensor, max_weight_ratio: float,
    clip_radius: float, clip_iterations: int, agreeing: bool = False,
) -> Combined:
    """Applies ``rule`` ('mean', 'centered_clip' or 'trimmed_mean') to ``rows`` with capped ``claims``.
    ``agreeing``: honest members send identical rows (the parameters of one state), so identical rows are each
    a member, not copies, and an honest majority's common row is the result."""
    if rule == "mean":
        return weighted_mean(rows, cap_weights(claims, max_weight_ratio), out)
    if rule not in ("centered_clip", "trimmed_mean"):
        raise ValueError(f"unknown aggregation rule {rule!r}")
    first = list(range(rows.shape[0])) if agreeing else distinct(rows)
    kept = [i for i, f in enumerate(first) if f == i]
    if len(kept) == rows.shape[0]:
        return _robust(rule, rows, cap_weights(claims, max_weight_ratio), out, clip_radius, clip_iterations)
    weights = cap_weights([claims[i] for i in kept], max_weight_ratio)
    result = _robust(rule, rows.index_select(0, torch.tensor(kept)), weights, out, clip_radius, clip_iterations)
    fraction, weight, coefficients = [0.0] * len(first), [0.0] * len(first), [0.0] * len(first)
    for position, i in enumerate(kept):
        fraction[i], weight[i] = result.kept[position], result.weights[position]
        if result.coefficients is not None:
            coefficients[i] = result.coefficients[position]
    return Combined(fraction, weight, coefficients if result.coefficients is not None else None, result.medoid,
                    result.gram, result.norms, first)


def _robust(rule: str, rows: torch.Tensor, weights: list[float], out: torch.Tensor, clip_radius: float,
            clip_iterations: int) -> Combined:
    if rows.shape[0] < ROBUST_MIN_MEMBERS:
        return equalized_mean(rows, weights, out, (rows @ rows.t()).double())
    if rule == "centered_clip":
        return centered_clip(rows, weights, out, clip_radius, clip_iterations)
    return trimmed_mean(rows, weights, out)
