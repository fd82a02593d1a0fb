"""The DHT wait bound (peerd/swarm/stragglers.py): how long a request waits, and which late answers count."""

from __future__ import annotations

import asyncio

from hivemind.dht.node import Blacklist, DHTNode
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from peerd.swarm import stragglers
from peerd.swarm.stragglers import WaitBound, guard_node


def test_before_any_answer_a_request_waits_the_ceiling_and_off_it_always_does() -> None:
    assert WaitBound(8.0, 1.0, 5.0).wait() == 5.0
    off = WaitBound(None, 1.0, 5.0)
    for peer in "abc":
        assert off.answered(peer, 0.01, 5.0, ok=True)
    assert off.answered("slow", 4.9, 5.0, ok=True) and off.wait() == 5.0


def test_the_wait_follows_the_typical_peer_within_floor_and_ceiling() -> None:
    bound = WaitBound(8.0, 1.0, 5.0)
    for peer in "abc":
        bound.answered(peer, 0.01, 5.0, ok=True)
    assert bound.wait() == 1.0  # 8 x 10 ms is under the floor
    for peer in "abc":
        for _ in range(16):
            bound.answered(peer, 0.3, 5.0, ok=True)
    assert abs(bound.wait() - 2.4) < 1e-9
    for peer in "abc":
        for _ in range(16):
            bound.answered(peer, 2.0, 5.0, ok=True)
    assert bound.wait() == 5.0


def test_one_slow_peer_does_not_raise_the_bound_it_is_held_to() -> None:
    bound = WaitBound(8.0, 1.0, 5.0)
    for peer in "ab":
        bound.answered(peer, 0.01, 5.0, ok=True)
    for _ in range(100):
        bound.answered("slow", 4.5, 5.0, ok=True)
    assert bound.wait() == 1.0


def test_late_answers_of_a_peer_slow_as_a_rule_do_not_count_and_an_honest_slow_moment_does() -> None:
    bound = WaitBound(8.0, 1.0, 5.0)
    for peer in "abc":
        for _ in range(4):
            assert bound.answered(peer, 0.01, 5.0, ok=True)
    # an honest peer with one slow answer among fast ones: its median stays low, every answer counts
    assert bound.answered("a", 0.9, 1.0, ok=True)
    assert bound.answered("a", 0.01, 1.0, ok=True)
    # a peer answering just under the wait every time: late (over 8 x 10 ms and 0.1 s), and slow as a rule from
    # its third answer (its first ones may have waited for a dial)
    assert bound.answered("slow", 0.9, 1.0, ok=True)
    assert bound.answered("slow", 0.9, 1.0, ok=True)
    assert not bound.answered("slow", 0.9, 1.0, ok=True)
    assert not bound.answered("slow", 0.9, 1.0, ok=True)
    assert bound.cut == 2
    # once it answers in time again, it counts again
    assert bound.answered("slow", 0.01, 1.0, ok=True)


def test_late_answers_of_a_peer_late_in_only_some_of_its_answers_do_not_count_once_its_mean_is_late() -> None:
    bound = WaitBound(8.0, 1.0, 5.0)
    for peer in "abc":
        for _ in range(4):
            assert bound.answered(peer, 0.01, 5.0, ok=True)
    # late in two answers of every five: its median stays fast, its earlier answers' mean (over 0.1 s) does not
    verdicts = [bound.answered("sly", seconds, 1.0, ok=True) for seconds in [0.01, 0.01, 0.9, 0.01, 0.9] * 4]
    assert verdicts[:3] == [True, True, True]  # a first late answer among fast ones: a slow moment
    assert all(verdicts[i] for i in range(20) if i % 5 in (0, 1, 3))  # its answers in time always count
    assert not any(verdicts[i] for i in range(4, 20) if i % 5 in (2, 4))
    assert bound.cut == 7


def test_an_answer_in_time_does_not_forgive_a_peer_late_as_a_rule_and_does_forgive_a_slow_moment() -> None:
    """hivemind's blacklist forgets a ban on any answer in time: a peer late in two answers of five was banned
    for 5 s again and again. Late as a rule, its bans now double; an honest peer's slow moment is forgiven."""
    bound = WaitBound(8.0, 1.0, 5.0)
    blacklist = Blacklist(5.0, 2.0)
    blacklist.__class__ = stragglers._PatientBlacklist
    blacklist.bound = bound
    for peer in "abc":
        for _ in range(4):
            bound.answered(peer, 0.01, 5.0, ok=True)
    sly, honest = PeerID(b"sly"), PeerID(b"honest")
    for seconds in [0.01, 0.01, 0.9, 0.01, 0.9]:
        bound.answered(str(sly), seconds, 1.0, ok=True)
    assert bound.slow(str(sly))
    blacklist.register_failure(sly)
    blacklist.banned_peers.clear()  # its ban ran out
    blacklist.register_success(sly)  # an answer in time
    blacklist.register_failure(sly)
    assert blacklist.ban_counter[sly] == 2  # banned 10 s this time, not 5 s again
    for seconds in [0.01, 0.01, 0.01, 0.9]:  # a slow moment: late on average until its answers in time outweigh it
        bound.answered(str(honest), seconds, 1.0, ok=True)
    blacklist.register_failure(honest)
    blacklist.banned_peers.clear()
    for _ in range(7):
        bound.answered(str(honest), 0.01, 1.0, ok=True)
        blacklist.register_success(honest)
    assert not bound.slow(str(honest))
    assert blacklist.ban_counter[honest] == 0 and honest not in blacklist


def test_a_request_cut_by_the_bound_is_counted_and_a_failure_at_the_ceiling_is_not() -> None:
    bound = WaitBound(8.0, 1.0, 5.0)
    assert not bound.answered("x", 1.0, 1.0, ok=False)
    assert not bound.answered("y", 5.0, 5.0, ok=False)  # hivemind's own timeout, as without the bound
    assert not bound.answered("z", 0.01, 1.0, ok=False)  # a refused stream: no answer, nothing cut
    assert bound.cut == 1


def test_a_bounded_node_still_answers_others_finds_them_and_shuts_down_cleanly() -> None:
    """hivemind names a protocol's handlers after its class: the switched class keeps DHTProtocol's names, or
    other peers could not call it and its shutdown would fail removing handlers it never registered."""

    async def scenario() -> None:
        first = await DHTNode.create(wait_timeout=5)
        second = await DHTNode.create(initial_peers=await first.get_visible_maddrs(), wait_timeout=5)
        try:
            for node in (first, second):
                await guard_node(8.0, 1.0, None, node)
            assert await first.store("key", b"value", get_dht_time() + 60, subkey="one")
            found = await second.get("key", latest=True)
            assert found is not None and found.value["one"].value == b"value"
            assert second.protocol.wait_timeout == 1.0  # the first answers set the bound: 8 x a few ms
        finally:
            await second.shutdown()
            await first.shutdown()  # raised P2PDaemonError before the handlers kept their names

    asyncio.run(asyncio.wait_for(scenario(), 60))
