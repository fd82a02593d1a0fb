"""The rows' energy per coarse block: each member states its row's L2 norm in every coarse block of a chunk
(``payloads.block_norms``), and a member's checks hold an average and a reducer's distances to them.

A reducer's own row is never sent to anyone: its sketch, samples and block norms are all its own word. Sketched
close to the others, so that the rule keeps it whole, it could still move the average far off on a few elements
that no sample hits. Block norms close that gap from both sides:

- **The average's norm.** Every rule peerd checks here makes each element a combination of the rows', so in
  every block the average's norm is at most the coefficients' combination of the rows' norms (for trimmed_mean,
  the root of their squares' sum), give or take the codec's error. A member holds the whole average, so a lie in
  any block shows unless its row's stated norm there covers it.
- **The distances.** Two rows' norms in a block differ by no more than the rows do there, so the sum over blocks
  of the norms' squared differences is at most the rows' squared distance (for a lone row, its squared norm).
  A row whose stated norms cover a lie must then be as far from the others as the lie is large, and the rule's
  coefficients, which follow from the distances, weigh it as such.

What a reducer can still hide is a row that stays within the distance it states: as much as any member's row,
which the rule weighs. Both bounds hold for honest rows exactly, but for float rounding, which the slack covers.
"""

from __future__ import annotations

import torch

__all__ = ["average_too_large", "distance_floor", "rows_too_far"]

# a stated norm against the row's: float32 sums of squares (~1e-7 from exact), added in another order on
# another machine, and the stated value rounded to float32; a misstatement that small moves nothing
NORM_TOLERANCE = 1e-5
# float32 sums of up to 64 rows, relative to the magnitudes summed (checks.ACCUMULATION)
ACCUMULATION = 1e-5
# a reducer's float32 Gram matrix against the exact distances: relative to the distance, and to the rows'
# squared distances from the medoid (float32 sums over a chunk lose ~1e-6 to ~1e-5 of them; ten times that)
DISTANCE_SLACK, DISTANCE_FLOAT = 1.01, 1e-4
TINY = 1e-30


def average_too_large(own: torch.Tensor, errors: torch.Tensor, norms: torch.Tensor,
                      coefficients: torch.Tensor | None) -> tuple[int, int] | None:
    """The first (chunk, coarse block) where a batch of averages is larger than its rows' stated ``norms``
    (chunks x rows x blocks, float64) allow under ``coefficients`` (chunks x rows; None: trimmed_mean over the
    rows given), or None. ``own``: the averages' block norms (chunks x blocks, :func:`payloads.block_norms`),
    ``errors``: how far an honest reducer's coded values may be from its exact average there
    (:func:`payloads.error_norms`)."""
    if own.shape[-1] != norms.shape[-1]:
        return 0, 0
    stated = norms * (1 + NORM_TOLERANCE)
    if coefficients is None:
        bound = (stated**2).sum(-2).sqrt()
    else:
        bound = (coefficients.abs().unsqueeze(-2) @ stated).squeeze(-2)
    allowed = bound * (1 + ACCUMULATION) + errors + TINY
    over = (own > allowed).nonzero()
    return (int(over[0, 0]), int(over[0, 1])) if over.numel() else None


def rows_too_far(norms: torch.Tensor, squared: torch.Tensor, around: torch.Tensor) -> bool:
    """Whether the rows' stated block ``norms`` (distinct rows x blocks, float64) put some two rows, or a row and
    zero, further apart than the squared distances ``squared`` the reducer published (rows x rows; or, a vector,
    the rows' squared norms); ``around``: each row's squared distance from the medoid (or squared norm), which
    sets the float slack. Leading dimensions are batches of chunks."""
    if squared.dim() == norms.dim():
        lower = distance_floor(norms)
        slack = DISTANCE_FLOAT * (around[..., :, None] + around[..., None, :])
    else:
        lower = ((norms * (1 - NORM_TOLERANCE)) ** 2).sum(-1)
        slack = DISTANCE_FLOAT * around
    return bool((lower > squared * DISTANCE_SLACK + slack + TINY).any())


def distance_floor(norms: torch.Tensor) -> torch.Tensor:
    """The least squared distance (rows x rows) that the rows' stated block ``norms`` (rows x blocks, with any
    leading batch dimensions) allow between each two rows, given the tolerance a stated norm is checked to."""
    left, right = norms[..., :, None, :], norms[..., None, :, :]
    gap = (left - right).abs() - NORM_TOLERANCE * (left + right)
    return (gap.clamp_min(0) ** 2).sum(-1)
