"""A member whose DHT node answers late (tests/integration/slow_dht.py, a patched `peerd start` that holds finds and
stores: each for 4.5 s, just under swarm.request_timeout, or 0.9 s; or two of every five for 0.9 s), with real
processes. Two members train on
configs/synthetic.yaml; the slow member is with them as a light peer (a DHT node, no training).

hivemind waits for every node a lookup asks, each up to one fixed timeout: without the wait bound
(``swarm.dht_wait_ratio: null``) every lookup that asks the slow member lasts about 4.5 s, and the members'
rounds slow to a crawl. With it, a request waits at most 8 times the typical peer's answer time (at least
``swarm.dht_wait_floor``, 1 s), and an answer that late from a peer whose answers are that late as a rule (in
median, or on average) does not count: the slow member's requests are cut short or its answers dropped, hivemind
skips it for 5 s, doubling, and the members average at close to their rate while it answers in time, also when
it answers just under the floor, in every answer or in two of every five. Rates are taken in alternate windows
with it in time and late: a before-and-after pair of windows measured the load that other tests put on the
machine in between as much as the slow member.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from peerd.launcher import LocalSwarm, PeerProcess, wait_for
from tests.helpers import PATCHED_ENV, SYNTHETIC, rounds, time_rounds
from tests.integration.swarms import honest_peer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

ROUNDS = 20


def run(log_dir: Path, defended: bool, delay: float = 4.5, share: float = 1.0, undefended: str | None = None,
        count: int = ROUNDS, floor: float | None = None) -> tuple[float, float | None, int]:
    """Two members (with ``undefended``, that defence off: tests/integration/undefended.py) train, and a third
    member joins as a light peer; then the second member's time for ``count`` rounds is taken in alternate windows,
    with the third member answering in time and late (in ``share`` of its answers, by ``delay``), twice each, so
    that the machine's load, which other tests change, weighs on both alike. Returns the seconds the windows took
    in all, in time and late (None: a late window not within 3x its in-time window plus 30 s defended, 2x plus
    10 s undefended), and the requests the second member cut short. ``floor``: every peer's
    ``swarm.dht_wait_floor``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    args = [] if defended else ["-o", "swarm.dht_wait_ratio=null"]
    args += [] if floor is None else ["-o", f"swarm.dht_wait_floor={floor}"]
    switch = log_dir / "slow"
    with LocalSwarm(SYNTHETIC, log_dir=log_dir, extra_args=args) as swarm:
        honest_peer(swarm, "member0", undefended).wait_ready(90)
        member = honest_peer(swarm, "member1", undefended)
        member.wait_ready(90)
        slow = PeerProcess("slow", ["--config", str(SYNTHETIC), "--control-port", "0", *args,
                                    "-o", "training.enabled=false",
                                    "--initial-peers", swarm.peers[0].ready["maddrs"][0]],
                           log_dir, env={**PATCHED_ENV, "SLOW_DHT_SECONDS": str(delay), "SLOW_DHT_SHARE": str(share),
                                         "SLOW_DHT_SWITCH": str(switch)}, module="tests.integration.slow_dht")
        swarm.peers.append(slow)
        slow.wait_ready(90)
        slow_id = slow.ready["peer_id"]
        # its record reached the member through a lookup: the member's DHT knows it, and asks it from now on
        wait_for(lambda: any(p["peer_id"] == slow_id for p in member.status(timeout=30)["peers"]), 60,
                 "the member to see the slow member", 0.5)
        wait_for(lambda: rounds(member) >= 3, 120, "the members to average 3 rounds", 0.5)
        in_time, late = 0.0, 0.0
        windows: list[tuple[float, float | None]] = []
        for _ in range(2):
            switch.unlink(missing_ok=True)
            fast = time_rounds(member, count, 120)
            assert fast is not None
            switch.touch()
            # undefended, twice as long as in time tells the damage: waiting longer only makes the test slower
            slowed = time_rounds(member, count, 3 * fast + 30 if defended else 2 * fast + 10)
            windows.append((round(fast, 1), slowed and round(slowed, 1)))
            in_time += fast
            if slowed is None:
                break
            late += slowed
        status = member.status(timeout=30)
        print(f"defended={defended} undefended={undefended}, {share:.0%} of answers after {delay} s: windows of "
              f"{count} rounds (in time, late) {windows}; DHT request median {status['dht_request_seconds']} s, "
              f"requests cut {status['dht_requests_cut']}")
        return in_time, None if windows[-1][1] is None else late, status["dht_requests_cut"]


def test_a_member_answering_the_dht_slowly_slows_no_round_for_long(tmp_path: Path) -> None:
    # just under request_timeout: the most an undefended member waits; just under the wait floor: the most a
    # request waits here, so only the late answers' verdict holds this one off
    for delay in (4.5, 0.9):
        baseline, attacked, cut = run(tmp_path / f"defended-{delay}", defended=True, delay=delay)
        assert attacked is not None and attacked <= 1.5 * baseline + 5, (delay, baseline, attacked)
        assert cut > 0
    baseline, attacked, cut = run(tmp_path / "undefended", defended=False)
    assert attacked is None, (baseline, attacked)
    assert cut == 0


def test_a_member_late_in_some_of_its_answers_is_judged_by_their_mean(tmp_path: Path) -> None:
    # late in two answers of every five, well under the wait floor: its median answer is fast, so only the mean
    # of its answers tells that it is slow as a rule (tests/integration/undefended.py ``dht-mean``: median only).
    # The floor is 2 s, not 1 s, so that a loaded machine's answer after 0.9 s is never cut by the floor, which
    # would skip the member on both sides alike and show no damage without the defence
    baseline, attacked, cut = run(tmp_path / "defended", defended=True, delay=0.9, share=0.4, count=20, floor=2.0)
    assert attacked is not None and attacked <= 1.5 * baseline + 5, (baseline, attacked)
    assert cut > 0
    median_only, slowed, _ = run(tmp_path / "median-only", defended=True, delay=0.9, share=0.4,
                                 undefended="dht-mean", count=20, floor=2.0)
    assert slowed is None or slowed > 2 * median_only, (median_only, slowed)
