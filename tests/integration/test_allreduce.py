"""The all-reduce over real p2pd instances (one process, several P2P daemons): results, faults, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import struct
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P

from peerd.averaging import compute
from peerd.averaging.allreduce import HANDLER_NAME, AllReducer
from peerd.averaging.group import Group
from peerd.averaging.layout import split_spans
from peerd.averaging.reducer import SpanReducer
from peerd.averaging.requests import PROTOCOL_VERSION
from peerd.averaging.verify.payloads import code_average
from peerd.averaging.verify.randomness import commitment, new_share
from peerd.averaging.verify.round import RoundVerification
from peerd.averaging.verify.verdict import Verdict
from peerd.config import AveragingConfig, CodecConfig, StreamLimits, VerificationConfig
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire import codec
from peerd.wire.frames import read_message, write_frame, write_message
from peerd.wire.guard import StreamGuard
from peerd.wire.membership import Membership
from tests.helpers import LISTEN, p2p_daemons
from tests.identities import new_identity

pytestmark = pytest.mark.integration

OPEN = Membership()
# These tests check the weighted mean and its fault handling; robust rules have tests of their own
# (tests/unit/test_aggregation.py, tests/integration/test_robust_averaging.py).
# No random audits here: some tests count every byte a round moves (one test below audits on purpose).
CONFIG = AveragingConfig(round_timeout=4.0, join_timeout=2.0, codec=CodecConfig(min_compress_numel=0),
                         aggregation="mean", verification=VerificationConfig(audit_probability=0.0))
# For tests whose rounds never wait for round_timeout: on a loaded machine an honest member's contribution may
# take longer than CONFIG's 4 s, and its exclusion would then fail a test about something else.
PATIENT = CONFIG.model_copy(update={"round_timeout": 30.0})


async def with_peers(
    n: int, body: Callable[[list[P2P], list[AllReducer]], Awaitable[Any]], config: AveragingConfig = CONFIG,
    transport: str = "tcp", membership: Membership = OPEN,
) -> Any:
    identities = [new_identity(Path(tempfile.mkdtemp(prefix="peerd-allreduce-")), f"peer{i}") for i in range(n)]
    async with p2p_daemons(n, LISTEN[transport], [path for path, _ in identities]) as p2ps:
        reducers = [AllReducer(StreamGuard(p, membership, StreamLimits()), config, signer)
                    for p, (_, signer) in zip(p2ps, identities, strict=True)]
        for reducer in reducers:
            await reducer.start()
        try:
            return await body(p2ps, reducers)
        finally:  # as a daemon stops: its audits and proof pushes end before its p2pd does
            for reducer in reducers:
                with contextlib.suppress(Exception):  # a daemon the test took away answers nothing
                    await reducer.stop()


def weighted_mean(xs: list[torch.Tensor], ws: list[float]) -> torch.Tensor:
    return sum(w * x for w, x in zip(ws, xs)) / sum(ws)  # type: ignore[return-value]


def test_split_spans_cover_and_align() -> None:
    spans = split_spans(1000, 3, 64)
    assert spans[0][0] == 0 and spans[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert all(start % 64 == 0 for start, _ in spans)
    tiny = split_spans(10, 4, 64)  # fewer blocks than members: one span holds everything, others are empty
    assert [end - start for start, end in tiny if end > start] == [10]


@pytest.mark.parametrize(("chunk_work", "transport"), [("inline", "tcp"), ("threads", "tcp"), ("inline", "quic")])
@pytest.mark.timeout(90)
def test_three_members_get_identical_weighted_mean_and_about_one_byte_per_element(
    chunk_work: str, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    numel = 300_000
    if chunk_work == "threads":  # what chunks above compute.INLINE_MAX_NUMEL elements take
        monkeypatch.setattr(compute, "INLINE_MAX_NUMEL", 0)

    async def body(p2ps: list[P2P], reducers: list[AllReducer]) -> None:
        members = tuple(sorted(r.peer_id for r in reducers))
        xs = [torch.randn(numel) for _ in reducers]
        ws = [1.0, 2.0, 5.0]
        outs = await asyncio.gather(
            *[r.all_reduce(Group("t1", members), x, w) for r, x, w in zip(reducers, xs, ws)]
        )
        expected = weighted_mean(xs, ws)
        for result, report in outs:
            assert torch.equal(result, outs[0][0])  # bit-identical on every member
            assert float((result - expected).norm() / expected.norm()) < 0.02
            assert report.excluded == {} and report.failed_spans == []
            # each member sends 2 of 3 spans as contributions and 2 averaged spans back: 4/3 of the tensor
            per_element = report.bytes_sent / (numel * 4 / 3)
            assert 1.0 < per_element < 1.1, per_element

    asyncio.run(with_peers(3, body, transport=transport))


@pytest.mark.timeout(120)
def test_a_member_that_decides_at_once_still_delivers_its_samples_over_quic(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member's samples are the last thing it writes on its stream to a reducer, and the other members' checks
    need them. Closing right after writing them lost them now and then over QUIC (p2pd resets a stream its writer
    closes, dropping what is in flight): here one member reaches its verdicts at once, and so would close right
    away, round after round; the others must still get its samples and apply every span."""
    fast: list[str] = []
    verdict = RoundVerification.verdict

    async def at_once(self: RoundVerification, span: int) -> Verdict:
        if self.me not in fast:
            return await verdict(self, span)
        self.verdicts[span] = Verdict(True)
        return self.verdicts[span]

    monkeypatch.setattr(RoundVerification, "verdict", at_once)

    async def body(p2ps: list[P2P], reducers: list[AllReducer]) -> None:
        members = tuple(sorted(r.peer_id for r in reducers))
        fast.append(reducers[0].peer_id)
        honest = reducers[1:]
        for step in range(6):
            xs = [torch.randn(50_000) for _ in reducers]
            outs = await asyncio.gather(*[r.all_reduce(Group(f"fast{step}", members), x, 1.0)
                                          for r, x in zip(reducers, xs, strict=True)])
            expected = weighted_mean(xs, [1.0] * len(xs))
            for result, report in outs[1:]:
                assert torch.equal(result, outs[1][0]), f"round {step}: a span was not applied"
                assert float((result - expected).norm() / expected.norm()) < 0.02
                assert report.excluded == {} and report.failed_spans == []
        assert all(not r.bans.reason(reducers[0].peer_id) for r in honest)

    asyncio.run(with_peers(3, body, config=PATIENT, transport="quic"))


@pytest.mark.timeout(90)
def test_lossless_rounds_are_exact_and_every_byte_sent_is_counted() -> None:
    """Averages go to every other member at once; each of those sends must reach the byte count (a counter
    read before an await lost them, with raw payloads big enough to make the writes wait)."""
    numel = 300_000

    async def body(p2ps: list[P2P], reducers: list[AllReducer]) -> None:
        members = tuple(sorted(r.peer_id for r in reducers))
        xs = [torch.randn(numel) for _ in reducers]
        lossless = CodecConfig(lossless=True, error_feedback=False)
        group = Group("t-raw", members)
        for bad_out in (torch.empty(numel - 1), torch.empty(numel, dtype=torch.float64), xs[0], xs[0][:]):
            with pytest.raises(ValueError, match="out must"):  # refused before anything is sent
                await reducers[0].all_reduce(group, xs[0], 1.0, codec_config=lossless, out=bad_out)
        buffers = [torch.full((numel,), math.nan) for _ in reducers]  # the caller's own result buffers
        outs = await asyncio.gather(*[
            r.all_reduce(group, x, 1.0, codec_config=lossless, out=buffer)
            for r, x, buffer in zip(reducers, xs, buffers)
        ])
        expected = weighted_mean(xs, [1.0, 1.0, 1.0])
        for (result, report), buffer in zip(outs, buffers):
            assert result is buffer
            assert torch.allclose(result, expected, atol=1e-6)
            for count in (report.bytes_sent, report.bytes_received):
                # the verification's messages are counted apart (check_bytes_*): ~10 KB per member here
                assert 0 < report.check_bytes_sent < 0.1 * report.bytes_sent, report
                assert 4.0 <= count / (numel * 4 / 3) < 4.04, count

    asyncio.run(with_peers(3, body))


@pytest.mark.timeout(90)
def test_error_feedback_residual_carries_quantization_error() -> None:
    async def body(p2ps: list[P2P], reducers: list[AllReducer]) -> None:
        members = tuple(sorted(r.peer_id for r in reducers))
        x = [torch.randn(50_000), torch.randn(50_000)]
        residuals = [torch.zeros(50_000), torch.zeros(50_000)]
        average_residuals = [torch.zeros(50_000), torch.zeros(50_000)]
        totals = [torch.zeros(50_000), torch.zeros(50_000)]
        rounds = 20
        for i in range(rounds):
            outs = await asyncio.gather(*[
                r.all_reduce(Group(f"ef{i}", members), xi, 1.0, res, average_residual=avg)
                for r, xi, res, avg in zip(reducers, x, residuals, average_residuals)
            ])
            for total, (out, _) in zip(totals, outs):
                total += out
        expected = (x[0] + x[1]) / 2
        one_round_error = float((outs[0][0] - expected).norm() / expected.norm())
        accumulated_error = float((totals[0] / rounds - expected).norm() / expected.norm())
        # both quantizations (contribution and average) are compensated: the running mean converges
        assert accumulated_error < one_round_error / 5, (accumulated_error, one_round_error)

    asyncio.run(with_peers(2, body))


@pytest.mark.timeout(90)
def test_a_member_that_never_shows_up_is_excluded_within_the_timeout() -> None:
    async def body(p2ps: list[P2P], reducers: list[AllReducer]) -> None:
        members = tuple(sorted(r.peer_id for r in reducers))
        absent = members[1]
        present = [r for r in reducers if r.peer_id != absent]
        xs = [torch.ones(10_000) * (i + 1) for i in range(len(present))]
        loop = asyncio.get_running_loop()
        started = loop.time()
        outs = await asyncio.gather(*[r.all_reduce(Group("t3", members), x, 1.0) for r, x in zip(present, xs)])
        assert loop.time() - started < CONFIG.round_timeout + 6
        for result, report in outs:
            assert absent in report.excluded
            assert torch.isfinite(result).all()
        # spans reduced by the two present members hold the mean of the two; the absent reducer's span
        # keeps each member's own values
        spans = split_spans(10_000, 3, CONFIG.codec.block_size)
        for result, _ in outs:
            for i, (start, end) in enumerate(spans):
                if members[i] != absent and end > start:
                    assert torch.allclose(result[start:end], torch.full((end - start,), 1.5), atol=0.02)

    asyncio.run(with_peers(3, body))


@pytest.mark.timeout(90)
def test_a_member_whose_input_cannot_be_coded_fails_fast_and_the_others_finish() -> None:
    async def body(p2ps: list[P2P], reducers: list[AllReducer]) -> None:
        members = tuple(sorted(r.peer_id for r in reducers))
        honest, broken = reducers
        good, bad = torch.ones(20_000), torch.ones(20_000)
        bad[0] = bad[-1] = math.nan  # in both spans: it can neither contribute nor average its own span
        (good_result, good_report), (bad_result, bad_report) = await asyncio.gather(
            honest.all_reduce(Group("t5", members), good, 1.0),
            broken.all_reduce(Group("t5", members), bad, 1.0),
        )
        # nobody waits for round_timeout: the broken member stops at its first chunk, its reducer refuses to
        # hand out an average it cannot code, and the honest reducer sees the broken stream end early
        assert good_report.duration < CONFIG.round_timeout and bad_report.duration < CONFIG.round_timeout
        assert "NaN" in bad_report.excluded[honest.peer_id]
        assert broken.peer_id in good_report.excluded
        assert torch.allclose(good_result, good, atol=0.01)  # nothing averaged with the broken member
        assert torch.isnan(bad_result).any()  # its own values, as it passed them

    asyncio.run(with_peers(2, body))


def nan_payload(numel: int) -> bytes:
    good = bytearray(codec.encode(torch.ones(numel), CONFIG.codec))
    head = codec.HEADER.size + 8  # 1-D: one shape entry
    struct.pack_into("<H", good, head, 0x7FC0)  # first bf16 scale := NaN
    return bytes(good)


@pytest.mark.parametrize("transport", LISTEN)
@pytest.mark.parametrize("fault", ["nan", "wrong_shape", "oversized", "bad_weight"])
@pytest.mark.timeout(90)
def test_bad_contributions_are_excluded_and_named(fault: str, transport: str) -> None:
    numel = 20_000

    async def body(p2ps: list[P2P], reducers: list[AllReducer]) -> None:
        members = tuple(sorted(r.peer_id for r in reducers))
        evil_p2p = p2ps[-1]
        evil_id = str(evil_p2p.peer_id)
        evil_key = reducers[-1].signing  # its credentials check out: what it sends is what is at fault
        honest = [r for r in reducers if r.peer_id != evil_id]
        spans = split_spans(numel, 3, CONFIG.codec.block_size)

        async def attack(target: str) -> tuple[int, bool]:
            """Sends one bad contribution; returns the first response's code and whether it was included."""
            index = members.index(target)
            span_numel = spans[index][1] - spans[index][0]
            payload = codec.encode(torch.ones(span_numel), CONFIG.codec)
            weight = 1.0
            if fault == "nan":
                payload = nan_payload(span_numel)
            elif fault == "wrong_shape":
                payload = codec.encode(torch.ones(span_numel + 64), CONFIG.codec)
            elif fault == "oversized":
                payload = bytes(10 * span_numel)
            elif fault == "bad_weight":
                weight = math.nan
            reader, writer = await StreamGuard(evil_p2p, OPEN, StreamLimits()).open(target, HANDLER_NAME)
            try:
                await write_message(writer, pb.ReduceRequest(
                    protocol_version=PROTOCOL_VERSION, round_id="t4", span_index=index, span_numel=span_numel,
                    weight=weight, chunk_numel=CONFIG.chunk_numel, credentials=evil_key.credentials,
                    seed_commitments=[commitment(new_share()) for _ in members]))
                await write_frame(writer, payload)  # the span is smaller than one chunk
                response = await read_message(reader, pb.ReduceResponse, target)
                return response.code, response.included
            finally:
                writer.close()

        xs = [torch.full((numel,), 2.0), torch.full((numel,), 4.0)]
        results = await asyncio.gather(
            *[r.all_reduce(Group("t4", members), x, 1.0) for r, x in zip(honest, xs)],
            *[attack(r.peer_id) for r in honest],
        )
        for code, included in results[2:]:
            # refused outright, or answered with the honest members' average that leaves it out
            assert code == pb.BAD_REQUEST or (code == pb.OK and not included), (code, included)
        for result, report in results[:2]:
            assert evil_id in report.excluded
            assert torch.isfinite(result).all()
            for i, (start, end) in enumerate(spans):
                if members[i] != evil_id:
                    assert torch.allclose(result[start:end], torch.full((end - start,), 3.0), atol=0.03)

    asyncio.run(with_peers(3, body, PATIENT, transport))


@pytest.mark.timeout(90)
def test_audits_of_honest_spans_recompute_them_and_exclude_nobody() -> None:
    """With every passing span audited, each member asks each reducer for a chunk's rows and recomputes it."""
    audited = PATIENT.model_copy(update={"verification": PATIENT.verification.model_copy(
        update={"audit_probability": 1.0})})

    async def body(p2ps: list[P2P], reducers: list[AllReducer]) -> None:
        members = tuple(sorted(r.peer_id for r in reducers))
        xs = [torch.randn(100_000) for _ in reducers]
        audited_bytes: list[list[int]] = [[] for _ in reducers]
        for r, counted in zip(reducers, audited_bytes):
            r.audits.on_bytes = lambda sent, received, counted=counted: counted.append(received)
        outs = await asyncio.gather(*[r.all_reduce(Group("audit", members), x, 1.0) for r, x in zip(reducers, xs)])
        # the round returns with the spans applied; their audits run on after it
        await asyncio.gather(*(r.audits.wait() for r in reducers))
        expected = weighted_mean(xs, [1.0] * 3)
        for (result, report), counted in zip(outs, audited_bytes):
            assert float((result - expected).norm() / expected.norm()) < 0.02
            assert report.unverified == {} and report.accused == {} and report.excluded == {}
            # two audits' rows came in: each holds its reducer's own row, lossless (4 bytes an element of a span)
            assert len(counted) == 2 and min(counted) > 4 * 100_000 / 3
        assert all(r.bans.status() == {} for r in reducers)

    asyncio.run(with_peers(3, body, audited))


@pytest.mark.timeout(120)
def test_a_group_of_five_under_the_robust_default_accuses_nobody() -> None:
    """Five members (a group size whose float32 Gram matrices came out asymmetric, and every honest reducer was
    convicted for it), the robust default, 8-bit codes, chunks of the default size, every passing span audited:
    every member applies every span, the same values everywhere, and nobody is accused."""
    robust = PATIENT.model_copy(update={"aggregation": "centered_clip", "codec": CodecConfig(),
                                        "verification": VerificationConfig(audit_probability=1.0)})
    assert robust.chunk_numel == 1 << 19

    async def body(p2ps: list[P2P], reducers: list[AllReducer]) -> None:
        members = tuple(sorted(r.peer_id for r in reducers))
        numel = len(reducers) * robust.chunk_numel  # a span of one full chunk each
        shared = torch.randn(numel)
        xs = [shared + 0.5 * torch.randn(numel) for _ in reducers]
        outs = await asyncio.gather(*[r.all_reduce(Group("five", members), x, 1.0) for r, x in zip(reducers, xs)])
        await asyncio.gather(*(r.audits.wait() for r in reducers))
        for result, report in outs:
            assert report.unverified == {} and report.accused == {} and report.excluded == {}, report
            assert torch.equal(result, outs[0][0])
        assert all(r.bans.status() == {} for r in reducers)

    asyncio.run(with_peers(5, body, robust))


@pytest.mark.timeout(120)
def test_a_span_whose_average_is_not_applied_keeps_the_residual_it_had(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under top-k nearly a whole row waits in the residual. A member that keeps its own values for a span whose
    average failed its checks has applied that row in full: the residual there stays as it was, or the part
    coding held back would be applied twice (once now, once when it is sent)."""
    topk = PATIENT.model_copy(update={"codec": CodecConfig(scheme="topk", min_compress_numel=0)})
    honest_average = SpanReducer._average_chunk
    liars: set[str] = set()

    def lying_average(self: SpanReducer, index: int) -> bytearray:
        payload = honest_average(self, index)
        if self.peer_id not in liars:
            return payload
        start, end = self.chunks[index]
        lie = code_average(self.out[start:end] * -1000.0, None, self.codec_config,
                           self.config.verification.check_narrow_codes, self.peer_id, self.counts[index])
        self.record.sign_output(index, lie)
        return lie

    monkeypatch.setattr(SpanReducer, "_average_chunk", lying_average)

    async def body(p2ps: list[P2P], reducers: list[AllReducer]) -> None:
        members = tuple(sorted(r.peer_id for r in reducers))
        liars.add(members[2])
        numel = 60_000
        xs = [torch.randn(numel) for _ in reducers]
        residuals = [0.1 * torch.randn(numel) for _ in reducers]
        before = [r.clone() for r in residuals]
        outs = await asyncio.gather(*[r.all_reduce(Group("kept", members), x, 1.0, res)
                                      for r, x, res in zip(reducers, xs, residuals)])
        spans = split_spans(numel, 3, topk.codec.block_size)
        for reducer, x, residual, old, (result, report) in zip(reducers, xs, residuals, before, outs):
            if reducer.peer_id in liars:
                continue
            assert set(report.unverified) == {2}, report.unverified  # the liar's span: own values, as they were
            start, end = spans[2]
            assert torch.equal(result[start:end], x[start:end])
            assert torch.equal(residual[start:end], old[start:end])
            # an honest reducer's span, applied: what top-k held back of this round's row went to the residual
            honest = next(i for i in range(2) if members[i] != reducer.peer_id)
            start, end = spans[honest]
            assert (residual[start:end] - old[start:end]).abs().sum() > 0.5 * x[start:end].abs().sum()

    asyncio.run(with_peers(3, body, topk))
