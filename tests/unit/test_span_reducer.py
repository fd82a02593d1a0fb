"""The reducer's chunk arithmetic (sums start lazily in the result slice), where chunk work runs, and the
validation of ReduceRequests; no network: contributions are handed to the reducer directly."""

from __future__ import annotations

import asyncio
import itertools
import math
import threading

import pytest
import torch

from peerd.averaging.compute import INLINE_MAX_NUMEL, run_chunk_work
from peerd.averaging.group import Group
from peerd.averaging.layout import chunk_bounds, split_spans
from peerd.averaging.reducer import SpanReducer
from peerd.averaging.requests import PROTOCOL_VERSION, check_request
from peerd.averaging.verify.payloads import clamp_residual, sent_count
from peerd.config import AveragingConfig, CodecConfig
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire import codec
from tests.identities import signers
from tests.unit import reducers

pytestmark = pytest.mark.timeout(30)

CODEC = CodecConfig(min_compress_numel=0)
CONFIG = AveragingConfig(chunk_numel=1024, codec=CODEC, aggregation="mean")  # the streaming path
ME, OTHER = (signer.peer_id for signer in signers(2))
GROUP = Group("round", (ME, OTHER))


def make_reducer(own: torch.Tensor, out: torch.Tensor, **kwargs: torch.Tensor) -> SpanReducer:
    return reducers.make_reducer(GROUP, own, 2.0, CONFIG, CODEC, out, **kwargs)


def test_nothing_is_written_before_a_chunk_is_touched() -> None:
    async def body() -> None:
        own, out = torch.randn(3000), torch.full((3000,), math.nan)
        own_residual = torch.ones(3000)
        reducer = make_reducer(own, out, own_residual=own_residual)
        # a round starts sending at once: no span-sized pass over memory happens up front
        assert torch.isnan(out).all() and bool((own_residual == 1).all())
        reducer.add(bytes(codec.encode(torch.ones(1024), CODEC)), OTHER, 1.0, 0, torch.empty(1024))
        assert not torch.isnan(out[:1024]).any() and torch.isnan(out[1024:]).all()
        assert bool((own_residual[:1024] == 0).all()) and bool((own_residual[1024:] == 1).all())
        reducer.close()

    asyncio.run(body())


def test_chunk_average_and_both_residuals_match_the_eager_formula() -> None:
    async def body() -> None:
        own, theirs = torch.randn(1024), torch.randn(1024)
        own_residual, residual = 0.1 * torch.randn(1024), 0.01 * torch.randn(1024)
        expected_sum = 2.0 * (own + own_residual)  # the reducer's own row enters exactly
        payload = bytes(codec.encode(theirs, CODEC))
        expected_sum += 3.0 * codec.decode(payload, peer_id=OTHER)
        average = expected_sum / 5.0
        clamped = residual.clone()
        clamp_residual(average, clamped, CODEC.block_size, int8=True)  # within half a step of the average
        carried = average + clamped  # what the reducer codes: the average plus its carried error
        expected_payload = codec.encode(carried, CODEC)
        expected_out = codec.decode(expected_payload, peer_id=ME)

        out = torch.empty(1024)
        reducer = make_reducer(own, out, residual=residual.clone(), own_residual=own_residual.clone())
        reducer.add(payload, OTHER, 3.0, 0, torch.empty(1024))
        got = reducer._average_chunk(0)
        assert bytes(got) == bytes(expected_payload)
        assert torch.equal(out, expected_out)
        assert torch.allclose(reducer.residual, carried - expected_out, atol=1e-6)
        assert bool((reducer.own_residual == 0).all())
        reducer.close()

    asyncio.run(body())


def test_with_top_k_the_average_returns_as_sparse8_its_largest_elements_and_what_it_leaves_out_stays_ours() -> None:
    """The average of a top-k row and the reducer's own row (exact: it is never sent) returns as SPARSE8, its k
    largest elements at 8 bits; what it leaves out of this peer's row goes back to this peer's residual (each
    member does the same with its own), and the average carries no residual of the reducer's."""
    async def body() -> None:
        topk = CodecConfig(scheme="topk", density=0.02, min_compress_numel=0)
        config = AveragingConfig(chunk_numel=4096, codec=topk, aggregation="mean")
        own, theirs = torch.randn(4096), torch.randn(4096)
        own_residual = torch.randn(4096)
        payload = bytes(codec.encode(theirs, topk))
        out = torch.empty(4096)
        reducer = reducers.make_reducer(GROUP, own, 2.0, config, topk, out, residual=torch.zeros(4096),
                                        own_residual=own_residual.clone())
        reducer.add(payload, OTHER, 3.0, 0, torch.empty(4096))
        got = bytes(reducer._average_chunk(0))
        k = math.ceil(0.02 * 4096)
        assert got[5] == codec.Scheme.SPARSE8 and sent_count(got) == k
        row = own + own_residual
        expected = (2.0 * row + 3.0 * codec.decode(payload, peer_id=OTHER, expected_shape=(4096,))) / 5.0
        carried = out != 0
        assert int(carried.sum()) == k and float(expected[~carried].abs().max()) <= float(
            expected[carried].abs().min())
        assert torch.allclose(out[carried], expected[carried], atol=float(expected.abs().max()) / 127)
        assert reducer.own_residual is not None
        assert torch.equal(reducer.own_residual, torch.where(carried, 0.0, row))  # what was left out waits
        assert bool((reducer.residual == 0).all())  # SPARSE8 carries no residual of the average
        reducer.close()

    asyncio.run(body())


def test_a_chunk_nobody_else_sent_averages_our_own_values() -> None:
    async def body() -> None:
        own, out = torch.randn(1024), torch.empty(1024)
        reducer = make_reducer(own, out)
        reducer.exclude(OTHER, "gone")
        await asyncio.wait_for(reducer.finish(5.0), 5.0)
        assert torch.allclose(out, own, atol=float(own.abs().max()) / 100)
        assert reducer.included[0] == {ME}
        reducer.close()

    asyncio.run(body())


@pytest.mark.parametrize("numel", [1024, INLINE_MAX_NUMEL + 1])
def test_small_chunks_run_inline_and_large_ones_in_a_thread(numel: int) -> None:
    async def body() -> int:
        return await run_chunk_work(numel, threading.get_ident)

    inline = asyncio.run(body()) == threading.get_ident()
    assert inline == (numel <= INLINE_MAX_NUMEL)


def test_requests_are_checked_against_the_reducers_view() -> None:
    async def body() -> None:
        reducer = make_reducer(torch.zeros(3000), torch.empty(3000))
        good = pb.ReduceRequest(protocol_version=PROTOCOL_VERSION, round_id="round", span_index=0, span_numel=3000,
                                weight=1.0, chunk_numel=1024, seed_commitments=[bytes(32)] * 2,
                                credentials=pb.Credentials(signing_key=bytes(32)))
        assert check_request(reducer.view, OTHER, good, set()) is None
        assert check_request(reducer.view, "12D3KooWStranger", good, set())[0] == pb.NOT_A_MEMBER
        for field, value in [("protocol_version", 99), ("span_index", 1), ("span_numel", 3001),
                             ("chunk_numel", 2048), ("weight", math.inf), ("weight", 0.0),
                             ("seed_commitments", [bytes(32)]), ("seed_commitments", [bytes(32), b""])]:
            bad = pb.ReduceRequest()
            bad.CopyFrom(good)
            if field == "seed_commitments":  # one a span, of 32 bytes each
                del bad.seed_commitments[:]
                bad.seed_commitments.extend(value)
            else:
                setattr(bad, field, value)
            code, reason = check_request(reducer.view, OTHER, bad, set())
            assert code == pb.BAD_REQUEST and reason, field
        assert check_request(reducer.view, OTHER, good, {OTHER})[0] == pb.DUPLICATE
        reducer.close()

    asyncio.run(body())


def test_layout_covers_every_element_once() -> None:
    spans = split_spans(10_000, 3, 128)
    assert spans[0][0] == 0 and spans[-1][1] == 10_000
    for start, end in spans:
        chunks = chunk_bounds(end - start, 1024)
        assert chunks[0][0] == 0 and chunks[-1][1] == end - start
        assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    assert chunk_bounds(0, 1024) == [(0, 0)]
