"""Matchmaking over an in-memory DHT whose stores become readable after a delay: when the peers' clocks disagree
(by up to the 3 s hivemind's DHT admits) every member reaches the same group as with agreeing clocks; when a
member lies (a registration at time 0, groups of its choosing, a decision it never publishes) the others
still form the groups they would have formed without it, and skip it as a leader."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from peerd.averaging import matchmaking
from peerd.averaging.decisions import decision_problem, split
from peerd.averaging.group import Group
from peerd.averaging.matchmaking import Matchmaker
from peerd.config import AveragingConfig
from peerd.errors import GroupFailed
from tests.unit.memory_dht import MemoryDHT, MemorySwarm

pytestmark = pytest.mark.timeout(60)

KEY = "run.abc123.grad.7"
PEERS = [f"Qm{letter * 44}" for letter in "ABCDEFGH"]
CONFIG = AveragingConfig(matchmaking_window=0.6, max_matchmaking_window=0.6, join_timeout=1.5, round_timeout=5.0,
                         target_group_size=4)


async def _join(dht: MemoryDHT, peer: str, offset: float, delay: float, expected: int,
                config: AveragingConfig = CONFIG) -> Group:
    await asyncio.sleep(delay)  # when this peer's batch is complete, in true time
    matchmaker = Matchmaker(MemorySwarm(peer, dht), config, clock=lambda: time.time() + offset)  # type: ignore[arg-type]
    return await matchmaker.form_group(KEY, expected)


async def _round(plan: list[tuple[float, float]], expected: int | None = None) -> list[Group | BaseException]:
    """``plan``: per peer, its clock offset and when (true time) it registers."""
    dht = MemoryDHT()
    joins = [_join(dht, PEERS[i], offset, delay, expected or len(plan)) for i, (offset, delay) in enumerate(plan)]
    return await asyncio.gather(*joins, return_exceptions=True)


@pytest.mark.parametrize("plan", [
    [(0.0, 0.0), (2.5, 0.1)],  # the later one's clock is ahead: its registration looks 2.6 s late
    [(0.0, 0.1), (2.5, 0.0)],
    [(0.0, 0.0), (-2.5, 0.1)],  # the later one's clock is behind: it registers "before" the first
    [(0.0, 0.1), (-2.5, 0.0)],
    [(-2.5, 0.0), (0.0, 0.05), (2.5, 0.1)],
    [(2.5, 0.0), (0.0, 0.05), (-2.5, 0.1)],
    [(2.9, 0.0), (-2.9, 0.3)],  # further apart than the DHT admits between two peers directly
], ids=lambda plan: " ".join(f"{offset:+g}s@{delay:g}" for offset, delay in plan))
def test_members_with_skewed_clocks_reach_the_same_group(plan: list[tuple[float, float]]) -> None:
    groups = asyncio.run(_round(plan))
    assert all(isinstance(group, Group) for group in groups), groups
    assert len({group.members for group in groups if isinstance(group, Group)}) == 1, groups
    assert set(groups[0].members) == set(PEERS[: len(plan)])  # type: ignore[union-attr]


def test_a_window_that_closes_without_everyone_is_the_same_decision_for_all() -> None:
    # 3 expected, 2 come: the leader closes after its window on its own clock and takes both
    groups = asyncio.run(_round([(2.5, 0.0), (-2.5, 0.2)], expected=3))
    assert all(isinstance(g, Group) and set(g.members) == set(PEERS[:2]) for g in groups), groups


def test_a_peer_behind_that_registers_after_the_decision_does_not_become_a_second_leader() -> None:
    async def scenario() -> list[Group | BaseException]:
        dht = MemoryDHT()
        on_time = [_join(dht, PEERS[i], 0.0, 0.0, 2) for i in range(2)]
        # 1 s later, but its clock is 2.5 s behind: its registration time is the earliest of all
        late = _join(dht, PEERS[2], -2.5, 1.0, 3)
        return await asyncio.gather(*on_time, late, return_exceptions=True)

    first, second, late = asyncio.run(scenario())
    assert isinstance(first, Group) and isinstance(second, Group) and first == second
    assert set(first.members) == set(PEERS[:2])
    assert isinstance(late, GroupFailed) and "registered too late" in str(late)


def test_of_two_racing_decisions_every_reader_takes_the_earliest_registered_leaders() -> None:
    dht = MemoryDHT(latency=0.0)
    t = time.time()
    dht.values[KEY, PEERS[0]] = (0.0, {"peer_id": PEERS[0], "t": t, "groups": [sorted([PEERS[0], PEERS[2]])]})
    dht.values[KEY, PEERS[1]] = (0.0, {"peer_id": PEERS[1], "t": t - 1.0, "groups": [sorted(PEERS[:3])]})
    group = asyncio.run(Matchmaker(MemorySwarm(PEERS[2], dht), CONFIG).form_group(KEY, 3))  # type: ignore[arg-type]
    assert set(group.members) == set(PEERS[:3])  # PEERS[1] registered earliest (on its clock), so its decision


@pytest.mark.parametrize("adaptive", [True, False], ids=["window grows with latency", "fixed window"])
def test_on_a_slow_dht_the_window_grows_so_a_follower_that_learned_late_still_makes_the_round(
    adaptive: bool,
) -> None:
    # every store takes 0.5 s; the follower learns of the round 0.8 s after the leader (a progress read and a
    # store later), so its registration lands 0.8 s after the leader's, past a 0.6 s window
    config = AveragingConfig(matchmaking_window=0.6, max_matchmaking_window=5.0 if adaptive else 0.6,
                             join_timeout=1.5, round_timeout=5.0, target_group_size=4)

    async def scenario() -> list[Group | BaseException]:
        dht = MemoryDHT(latency=0.0, store_seconds=0.5)
        joins = [_join(dht, PEERS[0], 0.0, 0.0, 3, config), _join(dht, PEERS[1], 0.0, 0.8, 3, config)]
        return await asyncio.gather(*joins, return_exceptions=True)

    leader, follower = asyncio.run(scenario())
    if adaptive:  # 6 x 0.5 s: the leader waits 3 s, and both average
        assert isinstance(leader, Group) and follower == leader and set(leader.members) == set(PEERS[:2])
    else:  # the damage without it: the leader closed alone, and neither averages
        assert isinstance(leader, GroupFailed) and "below min_group_size" in str(leader)
        assert isinstance(follower, GroupFailed) and "registered too late" in str(follower)


def test_the_window_is_the_configured_one_on_a_fast_dht_and_capped_on_a_slow_one() -> None:
    config = AveragingConfig(matchmaking_window=1.5, max_matchmaking_window=8.0)
    swarm = MemorySwarm(PEERS[0], MemoryDHT())
    matchmaker = Matchmaker(swarm, config)  # type: ignore[arg-type]
    assert matchmaker.window(1.5) == 1.5  # no requests timed yet
    for seconds in (0.01, 0.02, 0.5):
        swarm.latency.record(seconds)
    assert matchmaker.window(1.5) == 1.5  # median 20 ms: 120 ms is below the configured window
    for seconds in (1.0, 1.5, 1.2):
        swarm.latency.record(seconds)
    assert matchmaker.window(1.5) == pytest.approx(6 * 0.75)  # 6 x the median of 6, (0.5 + 1.0) / 2
    for _ in range(10):
        swarm.latency.record(5.0)  # timed out
    assert matchmaker.window(1.5) == 8.0
    assert matchmaker.window(12.0) == 12.0  # a longer window passed in (diloco's) is never shortened


def test_peers_that_register_after_the_decision_average_among_themselves() -> None:
    async def scenario() -> list[Group | BaseException]:
        dht = MemoryDHT()
        on_time = [_join(dht, PEERS[i], 0.0, 0.0, 2) for i in range(2)]  # expect 2: their leader closes at once
        late = [_join(dht, PEERS[i], 0.0, 0.5 + 0.1 * i, 4) for i in (2, 3)]
        return await asyncio.gather(*on_time, *late, return_exceptions=True)

    first, second, third, fourth = asyncio.run(scenario())
    assert isinstance(first, Group) and first == second and set(first.members) == set(PEERS[:2])
    assert isinstance(third, Group) and third == fourth and set(third.members) == set(PEERS[2:4])
    assert third.round_id.startswith(f"{KEY}.late/")  # a round of its own: no all-reduce mixes the two


# --- a member that lies ----------------------------------------------------------------------------------------

LIAR = f"Qm{'Z' * 44}"


def _liar_registers(dht: MemoryDHT, t: float, groups: list[list[str]] | None = None) -> None:
    entry: dict[str, Any] = {"peer_id": LIAR, "t": t}
    if groups is not None:
        entry["groups"] = groups
    dht.values[KEY, LIAR] = (0.0, entry)


async def _honest(dht: MemoryDHT, drops: list[str], matchmakers: list[Matchmaker] | None = None,
                  peers: int = 3) -> list[Group | BaseException]:
    matchmakers = matchmakers or [Matchmaker(MemorySwarm(PEERS[i], dht, drops), CONFIG)  # type: ignore[arg-type]
                                  for i in range(peers)]
    return await asyncio.gather(*(m.form_group(KEY, peers + 1) for m in matchmakers), return_exceptions=True)


def test_a_registration_at_time_zero_makes_nobody_the_leader() -> None:
    """Time 0 would make its author the leader of every round (and, never deciding, stall them all): it is
    dropped as implausible, and the honest peers group without it as fast as without any liar."""
    dht, drops = MemoryDHT(), []
    _liar_registers(dht, 0.0)
    started = time.monotonic()
    groups = asyncio.run(_honest(dht, drops))
    took = time.monotonic() - started
    assert all(isinstance(g, Group) and set(g.members) == set(PEERS[:3]) for g in groups), groups
    assert took < CONFIG.max_matchmaking_window + CONFIG.join_timeout  # no leader's deadline was waited out
    assert drops.count("implausible_time") == 3  # once per honest reader


@pytest.mark.parametrize("groups, why", [
    ([[LIAR, PEERS[0]], [PEERS[1], PEERS[2]]], "pairs of its choosing"),
    ([sorted([LIAR, *PEERS[:3]]), [PEERS[0]]], "a peer in two groups"),
    ([sorted([LIAR, *PEERS[:3], PEERS[5]])], "a peer that never registered"),
    ([sorted([LIAR, PEERS[0]]), sorted(PEERS[1:3])], "groups smaller than target_group_size"),
    ([[LIAR], [PEERS[0]], [PEERS[1]], [PEERS[2]]], "groups of one"),
])
def test_a_leaders_groups_must_be_the_split_of_its_members(groups: list[list[str]], why: str) -> None:
    """The liar registers first (a plausible time) and publishes groups of its choosing: refused and counted
    by every honest peer, which then follow the next registrant, who groups everyone as the rules say."""
    dht, drops = MemoryDHT(), []
    _liar_registers(dht, time.time() - 0.5, [sorted(group) for group in groups])
    results = asyncio.run(_honest(dht, drops))
    registered = {LIAR: 0.0, **{peer: 1.0 for peer in PEERS[:3]}}
    assert decision_problem(split(sorted(registered), 4, 2), registered, {}, 4, 2) is None  # what it had to decide
    assert decision_problem(groups, registered, {}, 4, 2) is not None, why
    assert all(isinstance(g, Group) and set(g.members) == set(PEERS[:3]) for g in results), (why, results)
    assert drops.count("bad_decision") == 3, drops


def test_a_leader_that_never_decides_delays_one_round_and_leads_no_more() -> None:
    """The liar registers first with a plausible time and never decides: the honest peers wait out its
    deadline once, then the next registrant leads; in the next round they pass over it at once."""
    config = CONFIG
    dht, drops = MemoryDHT(), []
    matchmakers = [Matchmaker(MemorySwarm(PEERS[i], dht, drops), config) for i in range(3)]  # type: ignore[arg-type]
    _liar_registers(dht, time.time() - 0.5)
    started = time.monotonic()
    groups = asyncio.run(_honest(dht, drops, matchmakers))
    first = time.monotonic() - started
    assert all(isinstance(g, Group) and set(g.members) == set(PEERS[:3]) for g in groups), groups
    assert first >= config.max_matchmaking_window + config.join_timeout  # its deadline, waited out once
    assert all(LIAR in m.skipped for m in matchmakers)
    dht.values.clear()
    _liar_registers(dht, time.time() - 0.5)
    started = time.monotonic()
    groups = asyncio.run(_honest(dht, drops, matchmakers))
    # it still averages (a registrant like any other), it just leads nothing
    assert all(isinstance(g, Group) and set(g.members) == {*PEERS[:3], LIAR} for g in groups), groups
    assert time.monotonic() - started < config.max_matchmaking_window + config.join_timeout


def test_a_round_gives_up_after_a_bounded_number_of_silent_leaders() -> None:
    """Sybils that register first and never decide cost one round at most MAX_FALLBACKS + 1 deadlines."""
    dht, drops = MemoryDHT(), []
    sybils = [f"Qm{letter * 44}" for letter in "STUVWXY"]
    for i, sybil in enumerate(sybils):
        dht.values[KEY, sybil] = (0.0, {"peer_id": sybil, "t": time.time() - 1.0 + 0.01 * i})
    (result,) = asyncio.run(_honest(dht, drops, peers=1))
    assert isinstance(result, GroupFailed) and f"{matchmaking.MAX_FALLBACKS + 1} leaders did not decide" in str(result)


def test_a_leader_waiting_out_a_peer_only_we_skip_is_not_passed_over() -> None:
    """The liar registers first and never decides. A skips it since an earlier round; B took that round's
    decision without waiting the liar out, so B still waits for it. B registered before A, so A's leader is B,
    which decides only after its own deadline for the liar: A gives it a fallback's time. Passed over at a first
    leader's deadline, B would publish [A, B] while A decided [A, liar], and each would take its own."""
    dht = MemoryDHT(store_seconds=0.5)  # a busy DHT: B's decision is readable well after B's deadline for the liar
    a, b = (Matchmaker(MemorySwarm(peer, dht), CONFIG) for peer in PEERS[:2])  # type: ignore[arg-type]
    a.skipped[LIAR] = time.monotonic() + matchmaking.SKIP_SECONDS
    _liar_registers(dht, time.time() - 0.5)

    async def both() -> list[Group | BaseException]:
        async def a_later() -> Group:
            await asyncio.sleep(0.1)
            return await a.form_group(KEY, 3)

        return await asyncio.gather(b.form_group(KEY, 3), a_later(), return_exceptions=True)

    groups = asyncio.run(both())
    assert all(isinstance(g, Group) and set(g.members) == set(PEERS[:2]) for g in groups), groups
    assert LIAR in b.skipped and PEERS[1] not in a.skipped
