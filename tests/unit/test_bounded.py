"""The bounded tables every per-peer memory uses: a stranger minting new peer ids cannot grow them."""

from __future__ import annotations

from collections import OrderedDict

from peerd.bounded import PeerMedians, remember


def test_the_least_recently_set_go_first_and_are_returned() -> None:
    table: OrderedDict[str, int] = OrderedDict()
    assert [remember(table, peer, i, 3) for i, peer in enumerate("abc")] == [[], [], []]
    assert remember(table, "a", 10, 3) == []  # set again: now the newest
    assert remember(table, "d", 4, 3) == [("b", 1)]
    assert list(table.items()) == [("c", 2), ("a", 10), ("d", 4)]


def test_a_flood_of_new_keys_keeps_the_table_at_its_limit() -> None:
    table: OrderedDict[int, None] = OrderedDict()
    dropped = [old for new in range(10_000) for old, _ in remember(table, new, None, 64)]
    assert len(table) == 64 and list(table) == list(range(10_000 - 64, 10_000))
    assert dropped == list(range(10_000 - 64))


def test_the_typical_value_is_the_lower_median_of_peer_medians_and_follows_every_new_value() -> None:
    medians = PeerMedians(kept=3, peers=4)
    assert medians.typical() is None
    medians.observe("slow", 9.0)
    assert medians.typical() == 9.0  # read (and cached) before the next value comes
    for _ in range(10):  # the slow peer sends more than the others, with one vote all the same
        medians.observe("slow", 9.0)
    medians.observe("a", 1.0)
    medians.observe("b", 2.0)
    assert medians.typical() == 2.0 and medians.median("slow") == 9.0 and medians.count("slow") == 3
    medians.observe("a", float("nan"))  # not positive and finite: teaches nothing
    medians.observe("a", 3.0)
    medians.observe("a", 5.0)  # a keeps 1, 3, 5: median 3
    assert medians.typical() == 3.0
    for peer in "cdef":  # four newer peers: the slow one, a and b are forgotten
        medians.observe(peer, 0.5)
    assert len(medians) == 4 and "slow" not in medians and medians.typical() == 0.5
