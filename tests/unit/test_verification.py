"""Verified reductions without a network (peerd/averaging/verify/): a member's checks of a span, the verdict on
a challenged chunk, proofs a third member checks alone, the seed, the ban list."""

from __future__ import annotations

import math

import blake3
import pytest
import torch

from peerd.averaging.clipping import clip_coefficients
from peerd.averaging.verify import checks, sketches
from peerd.averaging.verify.bans import BanList
from peerd.averaging.verify.checks import Inconsistent, check_chunk
from peerd.averaging.verify.disputes import judge_chunk
from peerd.averaging.verify.keys import KeyBook
from peerd.averaging.verify.payloads import view
from peerd.averaging.verify.proofs import (
    bad_reduction,
    check_proof,
    equivocation,
    false_samples,
    read_statement,
)
from peerd.averaging.verify.randomness import SKETCH_SIZE, RoundRandomness, commitment, span_seed
from peerd.averaging.verify.sketches import SKETCH_HIGH, SKETCH_LOW
from peerd.config import CodecConfig, VerificationConfig
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire import codec
from tests.unit.verified_chunks import NUMEL, Span, honest_rows

pytestmark = pytest.mark.timeout(60)


def check(span: Span, **edit: object) -> None:
    statement = span.statement(pb.SpanStatement(**edit) if edit else None)  # type: ignore[arg-type]
    check_chunk(statement, 0, span.all_samples(), span.out, view(span.out_payload), span.randomness, span.config)


@pytest.mark.parametrize("rule", ["mean", "centered_clip", "trimmed_mean"])
def test_an_honest_average_passes_whatever_the_reducer_carried(rule: str) -> None:
    # a stale residual from long ago, 10x the size of this round's step: clamped, so within the bound
    for seed in range(20):
        rows = honest_rows(4, seed=seed)
        residual = 0.1 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + seed))
        span = Span(rows, rule, weights=[1.0, 2.0, 1.0, 1.5], residual=residual, seed=bytes([seed]) * 32)
        check(span)


@pytest.mark.parametrize("rule", ["mean", "centered_clip", "trimmed_mean"])
def test_an_average_1000_times_too_large_fails(rule: str) -> None:
    span = Span(honest_rows(4), rule)
    span.average(lie=-1001 * span.out.clone())
    with pytest.raises(Inconsistent, match="the rule gives"):
        check(span)


def test_a_lie_on_one_element_no_sample_hits_shows_in_the_envelope() -> None:
    span = Span(honest_rows(4), "mean")
    hit = set(span.randomness.offsets(0, 0, NUMEL).tolist())
    element = next(i for i in range(NUMEL) if i not in hit)
    lie = torch.zeros(NUMEL)
    lie[element] = 1000.0
    span.average(lie)
    with pytest.raises(Inconsistent, match="magnitudes"):
        check(span)


def test_a_reducer_giving_its_own_row_more_weight_than_its_claim_fails() -> None:
    span = Span(honest_rows(3), "mean", weights=[1.0, 1.0, 1.0])
    span.coefficients = [0.8, 0.1, 0.1]  # its own row at 80%, consistent with what it codes
    span.out = torch.tensor(span.coefficients) @ span.decoded
    span.out_payload = bytes(codec.encode(span.out, span.config.codec))
    span.out = codec.decode(span.out_payload, peer_id="test")
    with pytest.raises(Inconsistent, match="not its rule's"):
        check(span)
    with pytest.raises(ProtocolViolation, match="2 chunks, expected 1"):  # a statement that does not fit the span
        check(span, chunks=[pb.ChunkRecord()])


def test_a_reducer_hiding_how_far_its_own_row_is_fails_the_sketch() -> None:
    """The attacker reduces span 0: its row (-1000x) is far off, and it publishes a Gram matrix in which it sits
    with the honest rows, so centered_clip would keep it whole. The coefficients follow from that matrix, the
    average from those coefficients: only the members' sketches can tell."""
    rows = honest_rows(4)
    rows[0] = -1000 * rows[1]
    span = Span(rows, "centered_clip")
    decoded = span.decoded.double()
    honest = decoded[1:].mean(0)
    fake = decoded.clone()
    fake[0] = honest + (decoded[1] - honest)  # where it claims to be: among the honest rows
    differences = fake - fake[1]
    span.gram, span.medoid = differences @ differences.t(), 1
    coefficients, _ = clip_coefficients(span.gram, [1.0] * 4, 1, span.config.clip_radius, span.config.clip_iterations)
    span.coefficients = coefficients.tolist()
    exact = (coefficients @ decoded).float()
    span.out_payload = bytes(codec.encode(exact, span.config.codec))
    span.out = codec.decode(span.out_payload, peer_id="test")
    assert float(span.out.norm()) > 100 * float(honest.norm())  # what the lie would do
    with pytest.raises(Inconsistent, match="sketched distances"):
        check(span)


def test_sketched_distances_stay_within_the_bounds_checks_use() -> None:
    """Dense honest differences and the worst case for the sketch's layout (an outer product): over many
    seeds the ratio of sketched to true squared distance stays inside [SKETCH_LOW, SKETCH_HIGH]."""
    generator = torch.Generator().manual_seed(7)
    dense = torch.randn(2**19, generator=generator)
    outer = torch.outer(torch.randn(128, generator=generator), torch.randn(4096, generator=generator)).reshape(-1)
    ratios = []
    for seed in range(300):
        randomness = RoundRandomness(seed.to_bytes(32, "big"), 2**19)
        for row in (dense, outer):
            sketch = randomness.sketch(0, seed % 7, row)
            ratios.append(float((sketch**2).sum() / SKETCH_SIZE) / float(row.double().norm() ** 2))
    assert SKETCH_LOW < min(ratios) and max(ratios) < SKETCH_HIGH, (min(ratios), max(ratios))


def test_a_challenged_chunk_convicts_a_lying_reducer_with_a_proof_any_member_checks() -> None:
    span = Span(honest_rows(4), "centered_clip")
    span.average(lie=-1001 * span.out.clone())
    statement = span.statement()
    rows = dict(enumerate(span.payloads))
    verdict = judge_chunk(statement, 0, span.group, rows, span.out_payload, span.all_samples(), span.config,
                          KeyBook())
    assert verdict.reducer is not None and "its rule applied to the sealed rows" in verdict.reducer
    assert verdict.members == {}
    evidence = bad_reduction(statement, 0, span.out_payload, span.out_signature, rows)
    # a member that was not there: a fresh key book, the statement read from the proof alone
    third, group = read_statement(evidence.proof.statement, KeyBook())
    assert check_proof(evidence.proof, third, group, evidence.frames, span.config, KeyBook()) is not None
    # the same proof with an honest average (signed by the reducer) shows nothing
    honest = Span(honest_rows(4), "centered_clip")
    proof = bad_reduction(honest.statement(), 0, honest.out_payload, honest.out_signature,
                          dict(enumerate(honest.payloads)))
    again, group = read_statement(proof.proof.statement, KeyBook())
    assert check_proof(proof.proof, again, group, proof.frames, honest.config, KeyBook()) is None


def test_a_member_that_misstates_its_row_to_frame_the_reducer_is_caught_instead() -> None:
    span = Span(honest_rows(4), "mean")
    statement = span.statement()
    samples = span.all_samples()
    samples[2] = span.samples(2, row=-1000 * span.decoded[2])
    with pytest.raises(Inconsistent):  # the honest average looks wrong against the lie
        check_chunk(statement, 0, samples, span.out, view(span.out_payload), span.randomness, span.config)
    verdict = judge_chunk(statement, 0, span.group, dict(enumerate(span.payloads)), span.out_payload, samples,
                          span.config, KeyBook())
    assert verdict.reducer is None  # the rows show the reducer applied its rule
    liar = span.group.members[2]
    assert set(verdict.members) == {liar}
    evidence = false_samples(statement, 0, samples[2], 2, span.payloads[2])
    third, group = read_statement(evidence.proof.statement, KeyBook())
    assert check_proof(evidence.proof, third, group, evidence.frames, span.config, KeyBook()) is not None
    # an honest member's samples, "proven" false the same way, show nothing
    honest = false_samples(statement, 0, samples[1], 1, span.payloads[1])
    assert check_proof(honest.proof, third, group, honest.frames, span.config, KeyBook()) is None


def test_two_signed_averages_of_one_chunk_convict_the_reducer() -> None:
    span = Span(honest_rows(3), "mean")
    statement = span.statement()
    ours = (blake3.blake3(span.out_payload).digest(), span.out_signature)
    other_payload = bytes(codec.encode(-1000 * span.out, span.config.codec))
    theirs = (blake3.blake3(other_payload).digest(), span.sign_output(other_payload))
    evidence = equivocation(statement, 0, ours, theirs)
    third, group = read_statement(evidence.proof.statement, KeyBook())
    assert check_proof(evidence.proof, third, group, [], span.config, KeyBook()) is not None
    forged = equivocation(statement, 0, ours, (theirs[0], bytes(64)))  # a signature the reducer never made
    assert check_proof(forged.proof, third, group, [], span.config, KeyBook()) is None


def test_a_spans_seed_needs_every_share_and_no_order() -> None:
    shares = {"b": bytes([2]) * 32, "a": bytes([1]) * 32}
    assert span_seed("r", 0, shares) == span_seed("r", 0, dict(reversed(list(shares.items()))))
    assert span_seed("r", 0, shares) != span_seed("r", 0, {**shares, "a": bytes(32)})
    assert span_seed("r", 0, shares) != span_seed("s", 0, shares)
    assert span_seed("r", 0, shares) != span_seed("r", 1, shares)
    assert commitment(shares["a"]) != commitment(shares["b"])


def test_bans_expire_are_bounded_and_a_proof_upgrades_a_suspicion() -> None:
    now = [0.0]
    bans = BanList(VerificationConfig(ban_seconds=100, suspect_seconds=10, max_bans=16), clock=lambda: now[0])
    assert bans.ban("p", "no answer", proven=False)
    assert not bans.ban("p", "again", proven=False)
    assert bans.ban("p", "wrong average", proven=True)
    assert bans.get("p") is not None and bans.get("p").proven  # type: ignore[union-attr]
    now[0] = 50.0
    assert bans.reason("p") is not None
    now[0] = 101.0
    assert bans.reason("p") is None
    for i in range(40):
        bans.ban(f"q{i}", "x", proven=True)
    assert len(bans.status()) == 16 and bans.get("q0") is None and bans.get("q39") is not None


def test_an_honest_reducer_is_never_convicted_where_float32_loses_the_distances() -> None:
    """Parameters of members that differ by 1e-5 of their size (state averaging), and rows so large that their
    Gram matrix overflows float32: the reducer's published numbers still check out, or nobody is convicted."""
    generator = torch.Generator().manual_seed(5)
    common = torch.randn(NUMEL, generator=generator)
    close = common + 1e-5 * torch.randn(4, NUMEL, generator=generator)
    span = Span(close, "centered_clip", codec=CodecConfig(lossless=True, error_feedback=False))
    check(span)
    verdict = judge_chunk(span.statement(), 0, span.group, dict(enumerate(span.payloads)), span.out_payload,
                          span.all_samples(), span.config, KeyBook())
    assert verdict.reducer is None and verdict.members == {}
    huge = Span(1e18 * honest_rows(4), "centered_clip")
    verdict = judge_chunk(huge.statement(), 0, huge.group, dict(enumerate(huge.payloads)), huge.out_payload,
                          huge.all_samples(), huge.config, KeyBook())
    assert verdict.reducer is None and verdict.members == {}


@pytest.mark.parametrize("members", range(3, 9))
def test_an_honest_reducer_passes_every_check_in_groups_of_any_size(members: int) -> None:
    """A chunk of the default size (2^19 elements), in groups of 3 to 8: float32 matrix products of 5 to 7 rows
    came out asymmetric by up to 6e-6 of the Gram matrix's diagonal, and every member then convicted the honest
    reducer of publishing a matrix that is not symmetric (groups of 5 at the README's `scripts/swarm --peers 5`)."""
    numel = 1 << 19
    generator = torch.Generator().manual_seed(members)
    rows = torch.randn(numel, generator=generator) + 0.5 * torch.randn(members, numel, generator=generator)
    span = Span(rows, "centered_clip", codec=CodecConfig())
    assert span.config.chunk_numel == numel
    check(span)
    verdict = judge_chunk(span.statement(), 0, span.group, dict(enumerate(span.payloads)), span.out_payload,
                          span.all_samples(), span.config, KeyBook())
    assert verdict.reducer is None and verdict.members == {}


def test_a_reducer_sampling_its_own_row_far_off_and_sketching_it_close_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reducer claims its own row close to the others in its Gram matrix and sketch, so centered_clip keeps
    it whole, and samples a row far off, chosen so that -1000x the honest average is the rule applied to the
    samples (verified_chunks.Span.misstate_own_row). Sketches and samples are each its own word; only how far
    apart the samples lie tells them apart."""
    span = Span(honest_rows(4), "centered_clip")
    samples = span.misstate_own_row()
    statement = span.statement()
    assert float(span.out.norm()) > 100 * float(span.decoded[1:].mean(0).norm())  # what the lie would do

    def checked() -> None:
        check_chunk(statement, 0, samples, span.out, view(span.out_payload), span.randomness, span.config)

    monkeypatch.setattr(sketches, "spread_bounds", lambda samples: torch.full((samples,), math.inf, dtype=torch.float64))
    with pytest.raises(Inconsistent, match="block norms lie further apart"):  # its block norms are the far row's
        checked()
    monkeypatch.setattr(checks, "rows_too_far", lambda *args: False)
    checked()  # without the samples' spread and the block norms' distances checked, the lie passes every other check
    monkeypatch.undo()
    with pytest.raises(Inconsistent, match="samples lie further apart"):
        checked()
    # the chunk's rows then convict the reducer: its samples misstate the row its statement names
    verdict = judge_chunk(statement, 0, span.group, dict(enumerate(span.payloads)), span.out_payload, samples,
                          span.config, KeyBook())
    assert span.group.members[0] in verdict.members and verdict.reducer is not None
