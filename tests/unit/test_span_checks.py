"""A span's chunks checked together (peerd/averaging/verify/checks.py ``check_chunks``): an honest span passes,
and a lie in any chunk fails the span naming that chunk and the reason its check alone gives; CenteredClip's
coefficients and the medoid check of a batch of chunks are those of each chunk alone."""

from __future__ import annotations

import numpy
import pytest
import torch

from peerd.averaging.aggregation import around, medoid_of
from peerd.averaging.clipping import clip_batch, clip_coefficients
from peerd.averaging.verify.checks import Inconsistent, check_chunk, check_chunks
from peerd.averaging.verify.coefficients import check_medoid, check_medoids
from peerd.averaging.verify.payloads import view
from peerd.config import CodecConfig
from tests.unit.verified_chunks import NUMEL, Chunks, Span, honest_rows

pytestmark = pytest.mark.timeout(120)

RULES = ["mean", "centered_clip", "trimmed_mean"]


def chunks(rule: str, count: int = 5, codec: CodecConfig | None = None) -> Chunks:
    return Chunks([Span(honest_rows(4, seed=i), rule, weights=[1.0, 2.0, 1.0, 1.5], codec=codec or CodecConfig())
                   for i in range(count)])


def check_all(span: Chunks) -> None:
    parts = span.parts
    check_chunks(span.statement(), list(range(len(parts))), span.samples(), [p.out for p in parts],
                 [view(p.out_payload) for p in parts], span.randomness, span.config, [0] * len(parts))


def alone(span: Chunks, index: int) -> str:
    """Why chunk ``index``'s check alone fails."""
    part = span.parts[index]
    with pytest.raises(Inconsistent) as failed:
        check_chunk(span.statement(), index, span.samples(), part.out, view(part.out_payload), span.randomness,
                    span.config)
    return str(failed.value)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("lossless", [False, True])
def test_an_honest_span_of_several_chunks_passes(rule: str, lossless: bool) -> None:
    check_all(chunks(rule, codec=CodecConfig(lossless=True, error_feedback=False) if lossless else None))


@pytest.mark.parametrize("rule", RULES)
def test_a_lie_in_one_chunk_fails_the_span_naming_that_chunk(rule: str) -> None:
    span = chunks(rule)
    span.parts[3].average(lie=-1001 * span.parts[3].out.clone())
    with pytest.raises(Inconsistent) as failed:
        check_all(span)
    assert failed.value.chunk == 3
    assert str(failed.value) == alone(span, 3)


def test_the_first_of_two_lies_is_named_with_the_reason_its_own_check_gives() -> None:
    span = chunks("centered_clip")
    # chunk 4: an average far off everywhere; chunk 1: one element no sample hits, 10^4 times the largest
    span.parts[4].average(lie=-1001 * span.parts[4].out.clone())
    hit = set(span.randomness.offsets(0, 1, NUMEL).tolist())
    element = next(i for i in range(NUMEL) if i not in hit)
    lie = torch.zeros(NUMEL)
    lie[element] = 1e4 * float(span.parts[1].out.abs().max())
    span.parts[1].average(lie=lie)
    with pytest.raises(Inconsistent) as failed:
        check_all(span)
    assert failed.value.chunk == 1
    assert str(failed.value) == alone(span, 1)
    assert "the rule gives" not in str(failed.value)  # no sample hits it: the envelope or the norms catch it


def test_a_batch_of_chunks_clips_as_each_chunk_alone() -> None:
    grams, weights, medoids = [], [], []
    generator = torch.Generator().manual_seed(7)
    for case in range(12):
        rows = torch.randn(5, 300, generator=generator, dtype=torch.float64)
        if case % 3 == 1:
            rows[case % 5] *= 100  # an outlier, clipped and left out
        if case % 4 == 2:
            rows[1:4] = rows[0]  # most rows equal the medoid: its row is the answer
        medoid = medoid_of(rows @ rows.t())
        grams.append(around(rows @ rows.t(), medoid))
        weights.append([1.0, 2.0, 1.0, 1.5, 1.0])
        medoids.append(medoid)
    batch, kept = clip_batch(torch.stack(grams).numpy(), numpy.asarray(weights), numpy.asarray(medoids), 2.0, 3)
    for i in range(len(grams)):
        one, fractions = clip_coefficients(grams[i], weights[i], medoids[i], 2.0, 3)
        assert numpy.array_equal(batch[i], one.numpy()), i
        assert kept[i].tolist() == fractions, i


def test_a_batch_with_a_wrong_medoid_fails_as_that_chunk_alone() -> None:
    rows = torch.randn(4, 300, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rows[3] *= 50  # far from the others: never their medoid
    medoid = medoid_of(rows @ rows.t())
    gram = around(rows @ rows.t(), medoid)
    check_medoids(torch.stack([gram, gram]).numpy(), numpy.asarray([medoid, medoid]))
    with pytest.raises(ValueError, match="is not the medoid") as batched:
        check_medoids(torch.stack([gram, gram]).numpy(), numpy.asarray([medoid, 3]))
    with pytest.raises(ValueError, match="is not the medoid") as single:
        check_medoid(gram, 3)
    assert str(batched.value) == str(single.value)
