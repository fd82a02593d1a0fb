"""Members seen absent (peerd.averaging.absences): the book of them, and a reducer's wait for them, which is a
grace beyond the rest (as long again as the rest took, within a fifth of ``join_timeout`` and all of it) instead
of the round's timeout; no network: chunks are handed to the reducer."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peerd.averaging.absences import Absences, grace
from peerd.averaging.group import Group
from peerd.averaging.reducer import SpanReducer
from peerd.config import AveragingConfig, CodecConfig
from peerd.wire import codec
from tests.identities import signers
from tests.unit import reducers

pytestmark = pytest.mark.timeout(30)

CODEC = CodecConfig(min_compress_numel=0)
# a round's timeout no test waits out: a member waited for that long fails the test's own timeout
CONFIG = AveragingConfig(chunk_numel=1024, codec=CODEC, aggregation="mean", round_timeout=600.0, join_timeout=0.2)
ME, OTHER, ABSENT = (signer.peer_id for signer in signers(3))
GROUP = Group("round", (ME, OTHER, ABSENT))


def make_reducer(watched: frozenset[str], config: AveragingConfig = CONFIG) -> SpanReducer:
    return reducers.make_reducer(GROUP, torch.zeros(2048), 1.0, config, CODEC, torch.empty(2048), watched=watched)


def deliver(reducer: SpanReducer, sender: str, index: int, value: float) -> None:
    """``sender``'s chunk ``index``, all ``value``, added as its stream would add it."""
    reducer.add(bytes(codec.encode(torch.full((1024,), value), CODEC)), sender, 1.0, index, torch.empty(1024))
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    reducer.added(done, sender, index)


async def averaged(reducer: SpanReducer) -> None:
    """Until every chunk of the span is averaged (what ``finish`` waits for before the statement, which needs the
    senders' seals)."""
    await asyncio.gather(*(event.wait() for event in reducer.ready))


def test_a_watched_member_that_sends_nothing_is_left_out_once_the_rest_is_in() -> None:
    async def body() -> None:
        reducer = make_reducer(frozenset({ABSENT}))
        deliver(reducer, OTHER, 0, 3.0)
        deliver(reducer, OTHER, 1, 3.0)
        await asyncio.wait_for(averaged(reducer), 10.0)  # not the round's 600 s
        assert reducer.late == {ABSENT} and "seen absent lately" in reducer.excluded[ABSENT]
        assert reducer.included == [{ME, OTHER}, {ME, OTHER}]
        assert torch.allclose(reducer.out, torch.full((2048,), 1.5), atol=0.05)  # (0 + 3) / 2
        reducer.close()

    asyncio.run(body())


def test_the_grace_is_as_long_again_as_the_rest_took_within_a_fifth_of_join_timeout_and_all_of_it() -> None:
    assert grace(0.01, join_timeout=5.0) == pytest.approx(1.0)  # a fast round: members start at different times
    assert grace(2.5, join_timeout=5.0) == pytest.approx(2.5)
    assert grace(60.0, join_timeout=5.0) == pytest.approx(5.0)


def test_a_watched_member_that_sends_nothing_to_a_fast_round_costs_it_less_than_join_timeout() -> None:
    async def body() -> None:
        config = CONFIG.model_copy(update={"join_timeout": 10.0})
        reducer = make_reducer(frozenset({ABSENT}), config)
        deliver(reducer, OTHER, 0, 3.0)
        deliver(reducer, OTHER, 1, 3.0)
        # the rest took no time: the grace is a fifth of join_timeout (2 s), well within join_timeout
        await asyncio.wait_for(averaged(reducer), 8.0)
        assert reducer.late == {ABSENT} and "2.0s behind" in reducer.excluded[ABSENT]
        reducer.close()

    asyncio.run(body())


def test_an_unwatched_member_that_sends_nothing_is_waited_for_until_the_timeout() -> None:
    async def body() -> None:
        reducer = make_reducer(frozenset())
        deliver(reducer, OTHER, 0, 3.0)
        deliver(reducer, OTHER, 1, 3.0)
        finishing = asyncio.ensure_future(averaged(reducer))
        # well past the watched member's grace, the span still waits for it
        await asyncio.sleep(5 * CONFIG.join_timeout)
        assert not finishing.done() and reducer.pending == [{ABSENT}, {ABSENT}] and not reducer.excluded
        finishing.cancel()
        reducer.close()

    asyncio.run(body())


def test_a_watched_member_that_keeps_pace_is_averaged_with() -> None:
    async def body() -> None:
        reducer = make_reducer(frozenset({ABSENT}))
        for index in (0, 1):
            deliver(reducer, OTHER, index, 3.0)
            deliver(reducer, ABSENT, index, 6.0)
        await asyncio.wait_for(averaged(reducer), 10.0)
        assert not reducer.excluded and not reducer.late
        assert torch.allclose(reducer.out, torch.full((2048,), 3.0), atol=0.05)  # (0 + 3 + 6) / 3
        reducer.close()

    asyncio.run(body())


def test_a_watched_member_that_falls_behind_keeps_the_chunks_it_sent_in_time() -> None:
    async def body() -> None:
        reducer = make_reducer(frozenset({ABSENT}))
        deliver(reducer, OTHER, 0, 3.0)
        deliver(reducer, ABSENT, 0, 6.0)
        deliver(reducer, OTHER, 1, 3.0)  # and the watched member never sends chunk 1
        await asyncio.wait_for(averaged(reducer), 10.0)
        assert reducer.late == {ABSENT} and "chunk 1" in reducer.excluded[ABSENT]
        assert reducer.included == [{ME, OTHER, ABSENT}, {ME, OTHER}]
        reducer.close()

    asyncio.run(body())


def test_the_book_watches_who_kept_a_round_waiting_until_it_completes_one_or_the_watch_ends() -> None:
    clock = [0.0]
    book = Absences(seconds=100.0, limit=2, clock=lambda: clock[0])
    book.note(GROUP, ME, {ABSENT: "sent nothing"}, excluded={ABSENT})
    assert book.watched(GROUP.members) == {ABSENT}
    assert "sent nothing" in book.status()[ABSENT]["reason"]
    # excluded from a later round for another reason (a broken stream): still watched
    book.note(GROUP, ME, {}, excluded={ABSENT})
    assert book.watched(GROUP.members) == {ABSENT}
    book.note(GROUP, ME, {}, excluded=set())  # it took part in full
    assert book.watched(GROUP.members) == set()
    book.saw(OTHER, "late")
    clock[0] = 100.0
    assert book.watched(GROUP.members) == set() and book.status() == {}
    for peer in ("a", "b", "c"):  # bounded: the oldest watch goes first
        book.saw(peer, "late")
    assert book.watched(["a", "b", "c"]) == {"b", "c"}
