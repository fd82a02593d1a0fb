"""Verified reductions under the robust rules' degenerate cases (peerd/averaging/verify/ with
peerd/averaging/aggregation.py): identical rows count once, fewer than 3 distinct rows are norm-equalized. An
honest reducer applying either passes every member's checks and is never convicted; a reducer that misstates a
pair's norms, calls a distinct row a copy or hides copies fails the checks or the dispute, and the proof
convicts it."""

from __future__ import annotations

import pytest
import torch

from peerd.averaging.aggregation import around, equalized_coefficients, medoid_of
from peerd.averaging.clipping import clip_coefficients
from peerd.averaging.group import STATE_KIND, is_state_round, round_key
from peerd.averaging.matchmaking import group_id
from peerd.averaging.verify.checks import Inconsistent, check_chunk
from peerd.averaging.verify.disputes import Judgment, judge_chunk
from peerd.averaging.verify.keys import KeyBook
from peerd.averaging.verify.payloads import bounded, checks_averages, sent_count, view
from peerd.averaging.verify.proofs import bad_reduction, check_proof, false_samples, read_statement
from peerd.averaging.verify.samples import MemberSamples
from peerd.averaging.verify.sketches import look_alike
from peerd.averaging.verify.statement import parse_statement, sign_statement
from peerd.config import CodecConfig
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire import codec
from peerd.wire.topk import choose_k
from tests.unit.verified_chunks import Span

pytestmark = pytest.mark.timeout(60)

NUMEL = 20_000
ROBUST = ["centered_clip", "trimmed_mean"]


def rows_of(n: int, seed: int = 0, scales: list[float] | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(NUMEL, generator=generator) + 0.5 * torch.randn(n, NUMEL, generator=generator)
    return rows * torch.tensor(scales or [1.0] * n)[:, None]


def check(span: Span, samples: dict[int, MemberSamples] | None = None) -> None:
    """Member 1's checks (its own top-k row's count is what a SPARSE8 average must carry)."""
    check_chunk(span.statement(), 0, samples or span.all_samples(), span.out, view(span.out_payload),
                span.randomness, span.config, sent_count(span.payloads[1]))


def judge(span: Span, samples: dict[int, MemberSamples] | None = None) -> Judgment:
    return judge_chunk(span.statement(), 0, span.group, dict(enumerate(span.payloads)), span.out_payload,
                       span.all_samples() if samples is None else samples, span.config, KeyBook())


def publish(span: Span, coefficients: list[float]) -> None:
    """The reducer codes and signs the average these coefficients give the sealed rows, as it states them."""
    span.coefficients = coefficients
    exact = (torch.tensor(coefficients, dtype=torch.float64) @ span.decoded.double()).float()
    span.out_payload = bytes(codec.encode(exact, span.config.codec))
    span.out = codec.decode(span.out_payload, peer_id="test", expected_shape=(NUMEL,))
    span.out_signature = span.sign_output(span.out_payload)


def proven(span: Span) -> str | None:
    """What a member that was not in the round finds in the proof a challenger sends."""
    evidence = bad_reduction(span.statement(), 0, span.out_payload, span.out_signature, dict(enumerate(span.payloads)))
    statement, group = read_statement(evidence.proof.statement, KeyBook())
    return check_proof(evidence.proof, statement, group, evidence.frames, span.config, KeyBook())


@pytest.mark.parametrize("rule", ROBUST)
def test_an_honest_pair_is_equalized_passes_and_is_not_convicted(rule: str) -> None:
    for seed in range(5):
        span = Span(rows_of(2, seed, [1.0, 30.0]), rule, weights=[1.0, 3.0], seed=bytes([seed]) * 32)
        assert span.norms is not None and span.same_as is None
        coefficients = torch.tensor(span.coefficients or [])
        # the larger row is scaled down to the smaller one's norm: neither side outweighs the other
        assert float(coefficients[1] * span.decoded[1].norm()) == pytest.approx(
            float(coefficients[0] * span.decoded[0].norm()), rel=1e-4)
        check(span)
        assert judge(span) == Judgment()
        assert proven(span) is None


@pytest.mark.parametrize("rule", ROBUST)
@pytest.mark.parametrize("copies", [[0, 1, 1, 3, 4], [0, 1, 0, 1, 1]])
def test_honest_copies_count_once_pass_and_are_not_convicted(rule: str, copies: list[int]) -> None:
    """Copies of one row among 3 distinct rows (the rule runs on 3), and among 2 (the pair is equalized)."""
    rows = rows_of(5, scales=[1.0, 1.0, 1.0, 1.0, 5.0])
    rows = rows[copies]
    span = Span(rows, rule)
    assert span.same_as == copies
    assert all(c == 0.0 for i, c in enumerate(span.coefficients or [0.0] * 5) if copies[i] != i)
    check(span)
    assert not look_alike(span.statement(), 0, span.all_samples())
    assert judge(span) == Judgment()
    assert proven(span) is None


def test_zero_rows_are_copies_of_each_other_and_pass() -> None:
    """Parts of a model no batch touched: every member's gradient is 0 there."""
    span = Span(torch.zeros(3, NUMEL), "centered_clip")
    assert span.same_as == [0, 0, 0] and float(span.out.abs().max()) == 0.0
    check(span)
    assert judge(span) == Judgment()


def test_a_reducer_understating_its_own_norm_in_a_pair_fails_and_is_convicted() -> None:
    """The reducer (member 0) sends -1000x its partner's row and publishes its norm as its partner's: the
    coefficients follow from those norms, the average from the coefficients; the sketches show the lie."""
    rows = rows_of(2)
    rows[0] = -1000 * rows[1]
    span = Span(rows, "centered_clip")
    honest = span.out.clone()
    span.norms = torch.full((2,), float(span.decoded[1].double().norm() ** 2), dtype=torch.float64)
    publish(span, equalized_coefficients(span.norms, [1.0, 1.0]).tolist())
    assert float(span.out.norm()) > 100 * float(honest.norm())  # what the lie would do
    with pytest.raises(Inconsistent, match="sketched norms"):
        check(span)
    verdict = judge(span)
    assert verdict.reducer is not None and "norms are not its rows'" in verdict.reducer and verdict.members == {}
    assert proven(span) is not None


def test_a_pair_norm_misstated_within_the_sketches_bounds_fails_the_block_norms_and_is_convicted() -> None:
    """A lie small enough to pass the sketches (2x on the norm) shows against the members' block norms, which
    add up to the rows' norms; the dispute settles it exactly."""
    rows = rows_of(2, scales=[3.0, 1.0])
    span = Span(rows, "trimmed_mean")
    assert span.norms is not None
    span.norms = span.norms * torch.tensor([0.25, 1.0], dtype=torch.float64)
    publish(span, equalized_coefficients(span.norms, [1.0, 1.0]).tolist())
    with pytest.raises(Inconsistent, match="block norms exceed the published norms"):
        check(span)
    verdict = judge(span)
    assert verdict.reducer is not None and "norms" in verdict.reducer
    assert proven(span) is not None


@pytest.mark.parametrize("rule", ROBUST)
def test_a_reducer_calling_a_distinct_row_a_copy_fails_and_is_convicted(rule: str) -> None:
    """The reducer drops member 3's row by calling it a copy of member 1's, with every other number and the
    average as the rule gives them for the rows it kept."""
    rows = rows_of(4)
    span = Span(rows, rule)
    liar = Span(rows[[0, 1, 2, 1]], rule)  # the world the statement describes: rows 0-2 are the real ones
    span.same_as, span.gram, span.medoid, span.norms = liar.same_as, liar.gram, liar.medoid, liar.norms
    span.coefficients, span.out, span.out_payload = liar.coefficients, liar.out, liar.out_payload
    span.out_signature = span.sign_output(span.out_payload)
    with pytest.raises(Inconsistent, match="row 3 as a copy of row 1, and the rows differ"):
        check(span)
    verdict = judge(span)
    assert verdict.reducer is not None and "copies" in verdict.reducer and verdict.members == {}
    assert proven(span) is not None


def test_a_reducer_hiding_copies_passes_the_checks_and_is_convicted_by_the_dispute() -> None:
    """Two of four rows identical (-1000x), counted as two members: the copies' row pulls twice. The samples and sketches of copies look like those of near-copies, which must not stop
    honest spans, so the checks pass; an audit's dispute compares the rows and convicts."""
    rows = rows_of(3)
    rows = torch.cat([rows, -1000 * rows[:1]])[[0, 1, 3, 3]]
    span = Span(rows, "centered_clip")
    assert span.same_as == [0, 1, 2, 2]
    honest = span.out.clone()
    first = span.decoded - span.decoded[0]
    gram = (first @ first.t()).double()
    medoid = medoid_of(gram)
    centered = around(gram, medoid)
    coefficients, _ = clip_coefficients(centered, [1.0] * 4, medoid, span.config.clip_radius,
                                        span.config.clip_iterations)
    span.same_as, span.gram, span.medoid, span.norms = None, centered, medoid, None
    publish(span, coefficients.tolist())
    assert float((span.out - honest).norm()) > 0.5 * float(honest.norm()), (span.out.norm(), honest.norm())
    check(span)
    assert look_alike(span.statement(), 0, span.all_samples())  # so the member audits the chunk
    verdict = judge(span)
    assert verdict.reducer is not None and "copies" in verdict.reducer
    assert proven(span) is not None


def test_near_copies_are_audited_and_their_honest_reducer_is_not_convicted() -> None:
    """Two rows equal but for one element no sample hits: they look alike to the checks, the span passes, and
    the audit's dispute finds the reducer right to count them apart."""
    lossless = CodecConfig(lossless=True, error_feedback=False)  # (8 bits would round the difference away)
    rows = rows_of(4)
    rows[3] = rows[2]
    span = Span(rows, "centered_clip", codec=lossless)
    hit = set(span.randomness.offsets(0, 0, NUMEL).tolist())
    rows[3, next(i for i in range(NUMEL) if i not in hit)] += 0.01
    span = Span(rows, "centered_clip", codec=lossless)
    assert span.same_as is None
    check(span)
    assert look_alike(span.statement(), 0, span.all_samples())
    assert judge(span) == Judgment()


def test_a_copy_misstating_its_samples_to_frame_the_reducer_is_convicted_instead() -> None:
    span = Span(rows_of(4)[[0, 1, 2, 2]], "centered_clip")
    samples = span.all_samples()
    samples[3] = span.samples(3, row=span.decoded[3] * 1.01)
    with pytest.raises(Inconsistent, match="copy"):
        check(span, samples)
    verdict = judge(span, samples)
    assert verdict.reducer is None and set(verdict.members) == {span.group.members[3]}
    evidence = false_samples(span.statement(), 0, samples[3], 3, span.payloads[3])
    statement, group = read_statement(evidence.proof.statement, KeyBook())
    assert check_proof(evidence.proof, statement, group, evidence.frames, span.config, KeyBook()) is not None


def test_a_statement_whose_copies_do_not_fit_its_rows_is_refused() -> None:
    span = Span(rows_of(3), "centered_clip")
    for same_as in ([0, 2, 2], [0, 0], [1, 1, 2]):
        message = pb.SpanStatement.FromString(span.statement().signed.body)
        message.chunks[0].same_as[:] = same_as
        with pytest.raises(ProtocolViolation, match="copies that do not fit"):
            parse_statement(sign_statement(span.signing[0], message), span.group, 0, NUMEL,
                            span.config.chunk_numel, KeyBook())


STATE_ROUND = "run.state.30/0123456789ab"  # a state-averaging round's id: members hold one state bit for bit


def test_a_round_kind_is_read_from_its_id() -> None:
    assert is_state_round(STATE_ROUND) and is_state_round(group_id(round_key("my.state.run", STATE_KIND, 3), ()))
    for gradient in ("round", "run.grad.30/0123", "run.outer.4/ab", "my.state.run.grad.3/ab", "run.state.x/ab"):
        assert not is_state_round(gradient), gradient


@pytest.mark.parametrize("rule", ROBUST)
def test_agreeing_members_outvote_a_liar_in_a_state_round_and_their_reducer_is_not_convicted(rule: str) -> None:
    """Three members send one state bit for bit, the fourth -1000x it: in a state round the three are members
    that agree, not copies, so their row is the average, and every check and dispute finds the reducer right.
    In a gradient round the same rows are one member's copies and a pair is equalized (the other tests)."""
    lossless = CodecConfig(lossless=True, error_feedback=False)
    state = rows_of(1)[0]
    span = Span(torch.stack([state, state, state, -1000 * state]), rule, codec=lossless, round_id=STATE_ROUND)
    assert span.same_as is None  # no copies
    assert torch.allclose(span.out, state, rtol=1e-5, atol=1e-6), float((span.out - state).abs().max())
    check(span)
    assert judge(span) == Judgment()
    assert proven(span) is None
    gradient = Span(span.rows, rule, codec=lossless)
    assert gradient.same_as == [0, 0, 0, 3]  # the same rows in a gradient round: copies


def test_a_state_round_statement_declaring_copies_is_refused() -> None:
    """A reducer cannot count agreeing members once in a state round (the liar's row would then be half the
    say): the round's id, which every member signs, says there are no copies."""
    span = Span(rows_of(1)[[0, 0, 0]], "centered_clip", codec=CodecConfig(lossless=True, error_feedback=False),
                round_id=STATE_ROUND)
    message = pb.SpanStatement.FromString(span.statement().signed.body)
    message.chunks[0].same_as[:] = [0, 0, 0]
    with pytest.raises(ProtocolViolation, match="copies in a state round"):
        parse_statement(sign_statement(span.signing[0], message), span.group, 0, NUMEL, span.config.chunk_numel,
                        KeyBook())


@pytest.mark.parametrize("scheme", ["topk", "blockwise2"])
def test_an_average_coded_with_error_feedback_is_left_unchecked_and_its_reducer_never_convicted(scheme: str) -> None:
    """With ``check_narrow_codes`` off, a top-k (or 2-bit) average carries most of what it drops into the
    reducer's next round: honest, it may be far from the exact one, by a residual only the reducer holds. Members
    that code so themselves apply it unchecked; those that check every average refuse it; a dispute never
    convicts its reducer."""
    narrow = CodecConfig(scheme=scheme, min_compress_numel=0)  # type: ignore[arg-type]
    rows = rows_of(4)
    span = Span(rows, "centered_clip", codec=narrow, residual=rows[0] * 3, check_narrow_codes=False)
    payload = view(span.out_payload)
    assert not bounded(payload) and not checks_averages(narrow, check_narrow_codes=False)
    assert checks_averages(CodecConfig(), False) and checks_averages(CodecConfig(lossless=True), False)
    with pytest.raises(Inconsistent):  # what a member that checks it would find: so it does not apply it
        check(span)
    assert judge(span) == Judgment()
    assert proven(span) is None


def sparse_rows(n: int, density: float, seed: int = 0) -> torch.Tensor:
    """What members of a top-k round contribute: each row's largest ``density`` share, as its payload carries
    them (the reducer averages the decoded rows)."""
    config = CodecConfig(scheme="topk", density=density, min_compress_numel=0)
    return torch.stack([codec.decode(codec.encode(row, config), peer_id="test", expected_shape=(NUMEL,))
                        for row in rows_of(n, seed)])


@pytest.mark.parametrize(("scheme", "coded"),
                         [("topk", codec.Scheme.SPARSE8), ("blockwise2", codec.Scheme.INT8_BLOCKWISE)])
@pytest.mark.parametrize("rule", ["mean", *ROBUST])
def test_narrow_codes_return_a_checkable_average_an_honest_one_passes_and_a_lie_is_convicted(
        scheme: str, coded: codec.Scheme, rule: str) -> None:
    """By default a reducer of top-k rows returns the k largest elements of its average at 8 bits (SPARSE8), one
    of 2-bit rows 8-bit blocks, without its residual: members check it like an 8-bit average. An honest one
    passes whatever the reducer carried and is never convicted; -1001x the average fails and the dispute's proof
    convicts the reducer."""
    narrow = CodecConfig(scheme=scheme, min_compress_numel=0)  # type: ignore[arg-type]
    assert checks_averages(narrow, check_narrow_codes=True)
    for seed in range(5):
        rows = sparse_rows(4, 0.02, seed) if scheme == "topk" else rows_of(4, seed)
        span = Span(rows, rule, codec=narrow, residual=3 * rows[0], seed=bytes([seed]) * 32)
        payload = view(span.out_payload)
        assert payload.scheme is coded and bounded(payload)
        if scheme == "topk":  # within the union of the members' supports, k of them (trimmed_mean leaves fewer)
            assert payload.support is not None
            union = torch.nonzero(span.decoded.abs().sum(0)).view(-1)
            assert bool(torch.isin(payload.support, union).all())
            assert payload.support.numel() <= choose_k(NUMEL, narrow.density)
            assert payload.support.numel() == choose_k(NUMEL, narrow.density) or rule == "trimmed_mean"
        check(span)
        assert judge(span) == Judgment()
        assert proven(span) is None
    span.average(lie=-1001 * span.out.clone())
    with pytest.raises(Inconsistent):  # at the samples, or in the envelope where they fall on zeros only
        check(span)
    assert judge(span).reducer is not None and proven(span) is not None


def test_a_sparse_average_leaving_out_large_elements_is_caught() -> None:
    """A reducer that leaves sampled elements out of the average (so that others, smaller, take their slots) is
    caught at the samples larger than the smallest it carries; the dispute, which recomputes the whole chunk,
    convicts it."""
    rows = sparse_rows(4, 0.3)
    span = Span(rows, "mean", codec=CodecConfig(scheme="topk", density=0.3, min_compress_numel=0))
    hit = span.randomness.offsets(0, 0, NUMEL)
    dropped = torch.zeros(NUMEL)
    dropped[hit] = span.out[hit]  # the sampled elements of the support, as a lie would need to hide from
    span.average(lie=-dropped)
    assert view(span.out_payload).scheme is codec.Scheme.SPARSE8
    with pytest.raises(Inconsistent, match="the rule gives"):
        check(span)
    assert proven(span) is not None


@pytest.mark.parametrize("rows_nonzero", [False, True])
def test_a_sparse_average_carrying_fewer_than_a_members_k_must_carry_every_nonzero_element(
        rows_nonzero: bool) -> None:
    """An average that carries fewer elements than a member's top-k row did claims to carry every nonzero one:
    an honest average of rows with few nonzero elements does and passes; a reducer that carries only the few
    largest of a full average (so that every element it leaves out passes as smaller) is caught and convicted."""
    config = CodecConfig(scheme="topk", density=0.05, value_bits=8, min_compress_numel=0)
    rows = sparse_rows(4, 0.05)
    if not rows_nonzero:
        rows[:, 100:] = 0.0  # fewer nonzero elements than k: all of them travel
    span = Span(rows, "mean", codec=config)
    check(span)
    assert judge(span) == Judgment() and proven(span) is None
    if not rows_nonzero:
        return
    k = sent_count(span.payloads[1])
    exact = torch.tensor(span.coefficients or []) @ span.decoded
    span.out_payload = bytes(codec.encode_largest(exact, config.block_size, k // 10))  # its 10% largest
    span.out = codec.decode(span.out_payload, peer_id="test", expected_shape=(NUMEL,))
    span.out_signature = span.sign_output(span.out_payload)
    with pytest.raises(Inconsistent, match="the rule gives"):
        check(span)
    assert judge(span).reducer is not None and proven(span) is not None


def test_a_small_element_rounded_up_by_a_large_neighbours_step_is_no_false_alarm() -> None:
    """A block of SPARSE8's sent values spans coarse blocks: rounding by the step of one member's large element
    lifts another's small one (0.03 of an exact average coded as 0.039) above its coarse block's bound from the
    rows. The envelope takes that rounding off, so the honest reducer passes; a lie on one element still shows."""
    rows = torch.zeros(4, NUMEL)
    generator = torch.Generator().manual_seed(1)
    for r in range(1, 4):
        rows[r, torch.randperm(NUMEL, generator=generator)[:200]] = torch.rand(200, generator=generator) * 0.01
    rows[1:, 4100] = 0.04  # the largest of its coarse block (elements 4096-8191)
    rows[0, 4090] = 10.0  # the neighbour in the union's block of sent values, in the coarse block before
    span = Span(rows, "mean", codec=CodecConfig(scheme="topk", value_bits=8, density=0.05, min_compress_numel=0))
    assert float(span.out[4100]) > 1.2 * 0.75 * 0.04  # rounded up by the neighbour's step
    check(span)
    lie = torch.zeros(NUMEL)
    lie[next(i for i in range(4096, 8192) if i not in set(span.randomness.offsets(0, 0, NUMEL).tolist()))] = 1.0
    span.average(lie)
    with pytest.raises(Inconsistent, match="magnitudes"):
        check(span)
