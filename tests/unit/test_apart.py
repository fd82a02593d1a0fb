"""A member absent from a watched member's rounds again is grouped apart, by a majority of its group only: what
each peer asks (absences.Absences.apart), how a decision must honour it (decisions.partition), and matchmaking
over an in-memory DHT with it."""

from __future__ import annotations

import asyncio

import pytest

from peerd.averaging.absences import APART_SECONDS, Absences
from peerd.averaging.decisions import decision_problem, partition, split
from peerd.averaging.group import Group
from peerd.averaging.matchmaking import Matchmaker
from peerd.config import AveragingConfig
from peerd.errors import GroupFailed
from tests.unit.memory_dht import MemoryDHT, MemorySwarm

pytestmark = pytest.mark.timeout(60)

KEY = "run.abc123.grad.7"
H0, H1, H2, H3, X = (f"Qm{letter * 44}" for letter in "ABCDX")
CONFIG = AveragingConfig(matchmaking_window=0.6, max_matchmaking_window=0.6, join_timeout=1.5, round_timeout=5.0,
                         target_group_size=4)


def test_a_member_most_of_its_group_asks_to_be_apart_from_is_grouped_apart() -> None:
    assert partition([H0, X, H1], {H0: [X], H1: [X]}, 4, 2) == [[H0, H1], [X]]
    # what the absent member asks changes nothing for an honest member (one of two others)
    assert partition([H0, X, H1], {X: [H0], H1: []}, 4, 2) == [sorted([H0, X, H1])]
    # nor what a minority of a group of its size asks, however large the swarm
    peers = [H0, H1, H2, H3, X, *(f"Qm{letter * 44}" for letter in "EFG")]
    assert partition(peers, {H0: [X]}, 4, 2) == split(peers, 4, 2)
    moved = partition(peers, {H0: [X], H1: [X]}, 4, 2)  # two of the three others a group of 4 would hold
    assert moved[-1] == [X] and split([p for p in peers if p != X], 4, 2) == moved[:-1]


def test_a_decision_must_group_apart_whom_most_of_its_group_asks_to() -> None:
    registered = {H0: 1.0, X: 2.0, H1: 3.0}
    apart = {H0: [X], H1: [X]}
    assert decision_problem([[H0, H1], [X]], registered, apart, 4, 2) is None
    problem = decision_problem([sorted([H0, X, H1])], registered, apart, 4, 2)
    assert problem is not None and "apart" in problem
    # a leader may not move a member only one of its group asked to be apart from
    assert decision_problem([[H0, H1], [X]], registered, {H0: [X]}, 4, 2) is not None


def test_a_watched_member_absent_again_is_asked_apart_from_for_a_time_that_doubles() -> None:
    clock = [0.0]
    book = Absences(seconds=300.0, clock=lambda: clock[0])
    book.saw(X, "sent nothing")
    assert book.watched([X]) == {X} and book.apart() == []  # once: only watched
    book.saw(X, "sent nothing again")
    assert book.apart() == [X] and book.status()[X]["apart_seconds_left"] == APART_SECONDS
    clock[0] += APART_SECONDS
    assert book.apart() == [] and book.watched([X]) == {X}  # back in groups, still waited for only a grace
    book.saw(X, "and again")
    assert book.status()[X]["apart_seconds_left"] == 2 * APART_SECONDS
    for _ in range(6):
        book.saw(X, "and again")
    assert book.status()[X]["apart_seconds_left"] == 150.0  # half the watch, which outlasts it
    book.kept_pace(X)
    assert book.apart() == [] and book.watched([X]) == set()
    book.saw(X, "after a round in full")
    assert book.apart() == []  # a new watch: once is not twice


async def _form(dht: MemoryDHT, peer: str, apart: list[str]) -> Group:
    matchmaker = Matchmaker(MemorySwarm(peer, dht), CONFIG, apart=lambda: apart)  # type: ignore[arg-type]
    return await matchmaker.form_group(KEY, 3)


def _round(asks: dict[str, list[str]]) -> list[Group | BaseException]:
    async def everyone() -> list[Group | BaseException]:
        dht = MemoryDHT()
        return await asyncio.gather(*(_form(dht, peer, asks.get(peer, [])) for peer in (H0, X, H1)),
                                    return_exceptions=True)
    return asyncio.run(everyone())


def test_honest_members_that_both_ask_are_grouped_without_the_absent_one() -> None:
    first, absent, second = _round({H0: [X], H1: [X]})
    assert isinstance(first, Group) and first == second and set(first.members) == {H0, H1}
    # alone, and nobody else expected was left out: it steps alone at once, no latecomers' round
    assert isinstance(absent, GroupFailed) and "no other peer expected" in str(absent), absent


def test_what_one_member_asks_alone_changes_no_group() -> None:
    groups = _round({X: [H0, H1]})  # the absent member, say, accusing both honest ones
    assert all(isinstance(g, Group) and set(g.members) == {H0, X, H1} for g in groups), groups
