"""A member that is grouped and never takes part, with real processes (tests/integration/liar.py, lie
``absent``): it registers for every round like any member, sends no contribution and holds every stream opened
to it as a reducer, unanswered. Each round it is grouped in waits for it: the round's timeout without the
defence (tests/integration/undefended.py ``absences``); with it, once each honest member has waited it out once,
a grace beyond the rest (as long again as the rest took, at least a fifth of ``join_timeout``), and once it kept
them waiting again, none: both ask to be grouped apart from it, and are, for 30 s, then 60 s, ...
(peerd.averaging.absences, decisions.partition). Measured as the honest trainers' steps per minute over the
same window, beside a swarm where the third member is honest."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from peerd.launcher import wait_for
from tests.helpers import SYNTHETIC, training
from tests.integration.swarms import honest_peer, private, spawn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WINDOW = 60.0  # seconds over which the honest trainers' pace is measured: two or three of the slowest rounds


def pace(log_dir: Path, third: str, undefended: str | None = None) -> dict[str, Any]:
    """Two honest trainers and a third member (``third``: 'honest' or 'absent'), all waiting for each other
    before their first step; once both honest trainers averaged a round, their steps and rounds over WINDOW
    seconds, and whom each watches at the end."""
    with private(SYNTHETIC, log_dir, "-o", "training.wait_for_peers=3") as swarm:
        first = honest_peer(swarm, "honest0", undefended)
        first.wait_ready(90)
        peers = [first, honest_peer(swarm, "honest1", undefended),
                 honest_peer(swarm, "honest2", undefended) if third == "honest"
                 else spawn(swarm, "absent", "tests.integration.liar", ("--lie", third))]
        for peer in peers:
            peer.wait_ready(90)
        honest, other = peers[:2], peers[2].peer_id
        wait_for(lambda: all(training(p)["rounds_ok"] >= 1 for p in honest), 240,
                 "both honest trainers to average a round", 1.0)
        before, began = [training(p) for p in honest], time.monotonic()
        # a rate needs a span of time: nothing to wait for but the clock
        wait_for(lambda: time.monotonic() - began >= WINDOW, WINDOW + 30, "the measuring window", 1.0)
        after, minutes = [training(p) for p in honest], (time.monotonic() - began) / 60
        found = {
            "steps_per_minute": [(a["step"] - b["step"]) / minutes for a, b in zip(after, before)],
            "rounds_per_minute": [(a["rounds_ok"] - b["rounds_ok"]) / minutes for a, b in zip(after, before)],
            "watched": [set(a["watched_peers"]) for a in after],
            # rounds of two over the window: the honest trainers without the third member
            "pairs": [a["group_sizes"].get("2", 0) - b["group_sizes"].get("2", 0) for a, b in zip(after, before)],
            "validation_loss": [a["validation_loss"] for a in after],
            "honest": [p.peer_id for p in honest], "third": other,
        }
        print(f"third={third} undefended={undefended}: steps/min "
              f"{[round(x, 1) for x in found['steps_per_minute']]}, rounds/min "
              f"{[round(x, 1) for x in found['rounds_per_minute']]}, rounds of two {found['pairs']}, "
              f"validation loss {found['validation_loss']}, "
              f"watching the third {[other in w for w in found['watched']]}")
        return found


def test_a_member_that_keeps_rounds_waiting_twice_is_grouped_apart_and_costs_nothing_more(tmp_path: Path) -> None:
    usual = pace(tmp_path / "usual", "honest")
    defended = pace(tmp_path / "defended", "absent")
    undefended = pace(tmp_path / "undefended", "absent", undefended="absences")
    # each honest trainer watches the absent member, and neither watches the other (nor, without it, anyone)
    assert all(defended["third"] in watched for watched in defended["watched"]), defended
    assert not set(defended["honest"]) & set().union(*defended["watched"]), defended
    assert not set().union(*usual["watched"]), usual
    # the two honest trainers average as a pair, without it: the absent member asks to be apart from both of them,
    # which moves neither
    assert all(pairs > 0 for pairs in defended["pairs"]) and not any(undefended["pairs"]), (defended, undefended)
    # waited for until the round's timeout, it slows them a hundredfold (30 s a round, where 0.3 s is usual); grouped
    # apart, it costs a grace now and then, when its time apart is up (the margin is this machine's noise)
    for slow, watched, free in zip(undefended["steps_per_minute"], defended["steps_per_minute"],
                                   usual["steps_per_minute"]):
        assert slow * 20 <= watched and watched >= 0.8 * free, (undefended, defended, usual)
