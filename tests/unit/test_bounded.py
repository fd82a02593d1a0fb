"""The bounded tables every per-peer memory uses: a stranger minting new peer ids cannot grow them."""

from __future__ import annotations

from collections import OrderedDict

from peerd.bounded import remember


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
