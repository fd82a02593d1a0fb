"""The rows' block norms in verified reductions (peerd/averaging/verify/energy.py): a reducer lying about its own
row on elements no sample hits is caught, honest rows never are, and a member misstating its norms is convicted
instead of the reducer."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from peerd.averaging.verify import checks, sketches
from peerd.averaging.verify.checks import Inconsistent, check_chunk
from peerd.averaging.verify.disputes import judge_chunk
from peerd.averaging.verify.keys import KeyBook
from peerd.averaging.verify.payloads import block_norms, view
from peerd.averaging.verify.samples import MemberSamples
from peerd.config import CodecConfig
from tests.unit.verified_chunks import CODEC, NUMEL, Span, honest_rows

pytestmark = pytest.mark.timeout(60)


def checked(span: Span, samples: dict[int, MemberSamples]) -> None:
    check_chunk(span.statement(), 0, samples, span.out, view(span.out_payload), span.randomness, span.config)


def sparse_lie(span: Span, seed: int, elements: int) -> torch.Tensor:
    """``elements`` elements of the chunk, at random among those where the honest average is at least as large
    as its root mean square (so -1000x of it is a lie far larger than the rows' distances)."""
    average = span.decoded[1:].mean(0)
    candidates = (average.abs() >= average.square().mean().sqrt()).nonzero().flatten()
    lie_on = torch.zeros(NUMEL, dtype=torch.bool)
    chosen = torch.randperm(candidates.numel(), generator=torch.Generator().manual_seed(seed))[:elements]
    lie_on[candidates[chosen]] = True
    return lie_on


@pytest.mark.parametrize("elements", [1, 20, 200])
def test_a_reducer_lying_about_its_own_row_where_no_sample_lands_is_caught(
    elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """-1000x the honest average on a few elements (0.005% to 1%), its own row sketched close: the samples' spread
    rarely sees it (switched off here, as if no sample landed there). Whichever norms it states for its own row
    give it away: the far row's lie further from the others than its published distances, the near row's do not
    cover the average."""
    monkeypatch.setattr(sketches, "spread_bounds", lambda samples: torch.full((samples,), math.inf, dtype=torch.float64))
    for seed in range(5):
        span = Span(honest_rows(4, seed=seed), "centered_clip", seed=bytes([seed + 1]) * 32)
        far = span.misstate_own_row(sparse_lie(span, seed, elements))
        with pytest.raises(Inconsistent, match="block norms lie further apart than the published distances"):
            checked(span, far)
        near_norms = block_norms(span.decoded[1:].double().mean(0).float(), CODEC.block_size)
        stated = far[0].spans[0]
        near = {**far, 0: dataclasses.replace(far[0], spans={0: dataclasses.replace(stated, norms=[near_norms])})}
        with pytest.raises(Inconsistent, match="average's norm in coarse block"):
            checked(span, near)
        with monkeypatch.context() as off:  # both checks off: the lie passes every other check
            off.setattr(checks, "rows_too_far", lambda *args: False)
            off.setattr(checks, "average_too_large", lambda *args: None)
            checked(span, far)


@pytest.mark.parametrize("rule", ["mean", "centered_clip", "trimmed_mean"])
@pytest.mark.parametrize("codec", [CODEC, CodecConfig(scheme="topk", min_compress_numel=0),
                                   CodecConfig(lossless=True, error_feedback=False),
                                   CodecConfig(scheme="blockwise8", min_compress_numel=NUMEL + 1)],
                         ids=["8bit", "topk", "lossless", "fp16"])
def test_honest_rows_pass_even_where_the_bounds_are_tight(rule: str, codec: CodecConfig) -> None:
    """Rows that are positive multiples of one another (their block norms differ exactly as much as the rows do,
    the tightest case), a pair of them (the norm-equalized mean), rows that are all the same, and ordinary
    ones: an honest reducer's average passes whatever it carried."""
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(NUMEL, generator=generator)
    for rows in (torch.stack([base, 2 * base, 3 * base, 0.5 * base]), torch.stack([base, 4 * base]),
                 base.repeat(4, 1), honest_rows(4, seed=7), 1e-20 * honest_rows(3)):
        span = Span(rows, rule, codec=codec)
        checked(span, span.all_samples())


def test_a_member_misstating_only_its_block_norms_is_convicted_not_the_reducer() -> None:
    """A member that states its block norms 1000x what it sealed (to make an honest average look too small for
    nothing) fails the checks, and the chunk's rows convict it, not the honest reducer."""
    span = Span(honest_rows(4), "centered_clip")
    samples = span.all_samples()
    stated = samples[2].spans[0]
    samples[2] = dataclasses.replace(samples[2], spans={0: dataclasses.replace(
        stated, norms=[1000 * stated.norms[0]])})
    with pytest.raises(Inconsistent, match="block norms"):
        checked(span, samples)
    verdict = judge_chunk(span.statement(), 0, span.group, dict(enumerate(span.payloads)), span.out_payload, samples,
                          span.config, KeyBook())
    assert verdict.reducer is None
    assert "block norms" in verdict.members[span.group.members[2]]
