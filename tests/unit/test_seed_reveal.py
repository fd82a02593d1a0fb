"""When a member reveals its seed share of a span (peerd/averaging/verify/round.py ``reveal``): only once it holds
that span's statement, or knows it never will, so nobody can draw a span's seed before its reducer committed; a
statement that comes after is not believed. And why that matters: told the seed before it commits, a reducer's
average negated wherever no sample falls passes every check."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peerd.averaging.group import Group
from peerd.averaging.verify.checks import Inconsistent, check_chunks
from peerd.averaging.verify.keys import KeyBook, SigningKey
from peerd.averaging.verify.payloads import view
from peerd.averaging.verify.randomness import RoundRandomness
from peerd.averaging.verify.round import RoundVerification
from peerd.config import AveragingConfig, CodecConfig
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from tests.identities import signers
from tests.unit.verified_chunks import Chunks, Span, honest_rows

pytestmark = pytest.mark.timeout(60)


def member(n: int = 3) -> RoundVerification:
    """Member 0 of a round of ``n`` members, each reducing 10 elements."""
    identities = signers(n)
    group = Group("round", tuple(i.peer_id for i in identities))
    spans = [(10 * i, 10 * (i + 1)) for i in range(n)]
    return RoundVerification(group, 0, SigningKey(identities[0]), KeyBook(), AveragingConfig(), spans,
                             torch.zeros(10 * n), lambda *_: None)


async def settle_loop() -> None:
    for _ in range(10):  # let every task the last change woke run
        await asyncio.sleep(0)


def test_a_member_reveals_its_share_of_a_span_only_once_that_spans_statement_is_in_or_never_will_be() -> None:
    async def body() -> None:
        v = member()
        revealing = {span: asyncio.ensure_future(v.reveal(span)) for span in range(3)}
        await settle_loop()
        assert not any(r.done() for r in revealing.values())  # no statement yet, not even its own span's
        await v.no_statement(2)  # span 2's exchange ended without one
        await settle_loop()
        assert revealing[2].done() and not revealing[1].done()  # span 1's reducer has yet to commit
        assert await revealing[2] == v.own_shares[2] and v.revealed == {2}
        with pytest.raises(ProtocolViolation, match="statement of"):
            await v.statement_from(1, pb.Signed())  # a statement in hand, however it reads (this one does not)
        assert await asyncio.wait_for(revealing[1], 5) == v.own_shares[1]
        assert not revealing[0].done()  # its own span's statement is not signed yet
        await v.no_statement(0)
        assert await asyncio.wait_for(revealing[0], 5) == v.own_shares[0]
        assert len(set(v.own_shares)) == 3 and v.revealed == {0, 1, 2}

    asyncio.run(body())


def test_a_statement_after_the_reveal_of_its_span_is_not_believed() -> None:
    async def body() -> None:
        v = member()
        await v.no_statement(1)
        assert await asyncio.wait_for(v.reveal(1), 5) == v.own_shares[1]
        await v.statement_from(1, pb.Signed())  # refused before it is read
        assert 1 not in v.statements
        assert "after this member revealed its seed share of the span" in v.problems[1]
        with pytest.raises(ProtocolViolation):  # span 2's share is not out: its statement is read
            await v.statement_from(2, pb.Signed())
        assert 2 not in v.revealed and "after this member revealed" not in v.problems[2]

    asyncio.run(body())


def test_a_share_must_match_the_commitment_for_its_span() -> None:
    async def body() -> None:
        v, other = member(), member()
        request = pb.ReduceRequest(seed_commitments=other.commitments_out)
        v.note_request("b", request)
        await v.reveal_from("b", 1, other.own_shares[1])
        assert v.shares[1]["b"] == other.own_shares[1]
        with pytest.raises(ProtocolViolation, match="span 2"):
            await v.reveal_from("b", 2, other.own_shares[1])  # span 1's share offered as span 2's
        with pytest.raises(ProtocolViolation, match="span 5"):
            await v.reveal_from("b", 5, other.own_shares[1])
        with pytest.raises(ProtocolViolation):
            await v.reveal_from("c", 0, other.own_shares[0])  # committed to nothing here
        assert "b" not in v.shares[2] and "c" not in v.shares[0]

    asyncio.run(body())


def test_told_the_seed_a_reducer_can_negate_its_average_wherever_no_sample_falls() -> None:
    """Every check passes at the seed the lie was made for; at any other seed the samples find it."""
    def span(seed: bytes) -> Chunks:
        parts = [Span(honest_rows(4, seed=i), codec=CodecConfig(), seed=seed) for i in range(3)]
        for index, part in enumerate(parts):
            length = part.rows.shape[1]
            unsampled = torch.ones(length, dtype=torch.bool)
            unsampled[RoundRandomness(bytes(32), part.config.chunk_numel).offsets(0, index, length)] = False
            lie = torch.zeros(length)
            lie[unsampled] = -2 * part.out[unsampled]  # the average negated there
            part.average(lie=lie)
        return Chunks(parts)

    def check(chunks: Chunks) -> None:
        parts = chunks.parts
        check_chunks(chunks.statement(), list(range(len(parts))), chunks.samples(), [p.out for p in parts],
                     [view(p.out_payload) for p in parts], chunks.randomness, chunks.config, [0] * len(parts))

    check(span(bytes(32)))  # the seed it was told
    with pytest.raises(Inconsistent, match="the rule gives"):
        check(span(bytes([1]) * 32))
