"""Split-brain detection (peerd.swarm.view): which views look partial, the debounce, the re-bootstrap backoff."""

from __future__ import annotations

import logging

import pytest

from peerd.metrics import StatusCollector
from peerd.swarm.view import CHECK_PERIOD, CONFIRM, MAX_BACKOFF, ViewWatch, judge

ME = "12D3KooWMe"
BOOT = "12D3KooWBootstrapPeerAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
BOOT_MADDR = f"/ip4/127.0.0.1/tcp/4001/p2p/{BOOT}"


def peers(n: int) -> list[str]:
    return [f"peer{i}" for i in range(n)]


@pytest.mark.timeout(10)
def test_a_view_as_large_as_every_report_is_whole() -> None:
    seen = [BOOT, *peers(10)]
    verdict = judge(seen, dict.fromkeys(seen, 12), [BOOT], ME, initial_alive=True)
    assert not verdict.partial and verdict.seen == 12 and verdict.expected == 12


@pytest.mark.timeout(10)
def test_far_fewer_than_another_peer_reports_is_partial() -> None:
    seen = [BOOT, *peers(6)]
    reports: dict[str, int | None] = {**dict.fromkeys(seen, 8), "peer3": 64}
    verdict = judge(seen, reports, [BOOT], ME, initial_alive=True)
    assert verdict.partial and verdict.seen == 8 and verdict.expected == 64
    assert verdict.reason is not None and "peer3 reports 64" in verdict.reason


@pytest.mark.timeout(10)
def test_a_record_or_two_behind_is_not_partial() -> None:
    # 3 of 4 is under the shortfall ratio but only one peer short: that record may just be late
    assert not judge([BOOT, "peer0"], {BOOT: 4, "peer0": 3}, [BOOT], ME, initial_alive=True).partial
    # 60 of 64: many missing in number but a small fraction (start-up spreads records over a few seconds)
    assert not judge([BOOT, *peers(58)], {BOOT: 64}, [BOOT], ME, initial_alive=True).partial


@pytest.mark.timeout(10)
def test_older_peers_without_a_count_are_no_evidence() -> None:
    assert not judge([BOOT], {BOOT: None}, [BOOT], ME, initial_alive=True).partial


@pytest.mark.timeout(10)
def test_initial_peer_answering_but_invisible_means_another_dht() -> None:
    verdict = judge(peers(2), dict.fromkeys(peers(2), 3), [BOOT], ME, initial_alive=True)
    assert verdict.partial and verdict.reason is not None and "initial peer" in verdict.reason
    # gone for good (no answer to the re-bootstrap's ping): its record expired normally
    assert not judge(peers(2), dict.fromkeys(peers(2), 3), [BOOT], ME, initial_alive=False).partial
    # the bootstrap peer itself, and a peer without initial peers, have no such evidence
    assert not judge([], {}, [ME], ME, initial_alive=True).partial
    assert not judge([], {}, [], ME, initial_alive=True).partial


@pytest.mark.timeout(10)
def test_watch_warns_and_rebootstraps_after_confirmation_then_backs_off(caplog: pytest.LogCaptureFixture) -> None:
    watch = ViewWatch([BOOT_MADDR], ME, period=2.0)
    assert watch.initial_ids == [BOOT]
    partial_view = ([BOOT, "peer0"], {BOOT: 3, "peer0": 40})
    caplog.set_level(logging.INFO, logger="peerd.swarm.view")
    decisions = [watch.observe(*partial_view, now=float(t)) for t in range(CONFIRM)]
    assert decisions == [False] * (CONFIRM - 1) + [True]
    assert watch.status()["partial"] and watch.status()["rebootstraps"] == 1
    assert watch.seen_count == 3
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "Partial view" in caplog.records[0].getMessage()
    watch.rebootstrapped(answered=1)
    # still partial: the next re-bootstrap waits one period, then two, ... up to MAX_BACKOFF
    first = CONFIRM - 1.0
    assert not watch.observe(*partial_view, now=first + 1.9)
    assert watch.observe(*partial_view, now=first + 2.0)
    assert not watch.observe(*partial_view, now=first + 2.0 + 3.9)
    assert watch.observe(*partial_view, now=first + 2.0 + 4.0)
    for step in range(20):
        watch.observe(*partial_view, now=1e6 * (step + 1))
    assert watch._backoff == MAX_BACKOFF
    # whole again: one INFO line, the streak and the backoff start over
    assert not watch.observe([BOOT, *peers(39)], {BOOT: 41}, now=2e7)
    assert not watch.status()["partial"]
    assert caplog.records[-1].levelno == logging.INFO and "whole again" in caplog.records[-1].getMessage()
    assert watch._backoff == MAX_BACKOFF  # one whole check is not enough: an overloaded swarm's views flap
    for t in range(CONFIRM - 1):
        watch.observe([BOOT, *peers(39)], {BOOT: 41}, now=2e7 + t + 1)
    assert watch._backoff == 2.0


@pytest.mark.timeout(10)
def test_a_passing_dip_does_not_trigger() -> None:
    watch = ViewWatch([BOOT_MADDR], ME, period=2.0)
    whole = ([BOOT, *peers(10)], {BOOT: 12})
    dip = ([BOOT, "peer0"], {BOOT: 12})
    for t in range(10):  # partial for CONFIRM - 1 ticks at most, then whole again
        assert not watch.observe(*(dip if t % CONFIRM else whole), now=float(t))


@pytest.mark.timeout(10)
def test_reads_that_keep_failing_count_as_a_partial_view(caplog: pytest.LogCaptureFixture) -> None:
    # an overloaded peer whose every read times out sees nobody: it must say so and re-bootstrap, not stay quiet
    watch = ViewWatch([BOOT_MADDR], ME, period=2.0)
    assert not watch.observe([BOOT, *peers(10)], {BOOT: 12}, now=0.0)
    caplog.set_level(logging.INFO, logger="peerd.swarm.view")
    error = "reading 8 keys (run.peers.0 ...) timed out after 5.0s"
    decisions = [watch.failed_read(error, now=float(t + 1)) for t in range(CONFIRM)]
    assert decisions == [False] * (CONFIRM - 1) + [True]
    status = watch.status()
    assert status["partial"] and status["rebootstraps"] == 1 and error in status["reason"]
    assert status["seen"] == 12  # the last view read stays what status shows
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and error in caplog.records[0].getMessage()
    # one failure between good reads is a slow read, not evidence
    watch = ViewWatch([BOOT_MADDR], ME, period=2.0)
    for t in range(10):
        assert not (watch.failed_read(error, now=float(t)) if t % 2 else watch.observe([BOOT], {BOOT: 2}, float(t)))


@pytest.mark.timeout(10)
def test_read_latency_percentiles() -> None:
    watch = ViewWatch([], ME, period=2.0)
    assert watch.status()["read_seconds"] == {"count": 0, "p50": None, "p99": None}
    watch.read_seconds.extend([0.01] * 99 + [1.0])
    reads = watch.status()["read_seconds"]
    assert reads["count"] == 100 and reads["p50"] == 0.01 and reads["p99"] == 1.0


@pytest.mark.timeout(10)
def test_checks_are_spaced_by_the_check_period() -> None:
    watch = ViewWatch([], ME, period=2.0)
    assert watch.due(100.0)
    assert not watch.due(100.0 + CHECK_PERIOD - 0.1)
    assert watch.due(100.0 + CHECK_PERIOD)


@pytest.mark.timeout(10)
def test_a_partial_view_shows_in_the_status_text_and_metrics() -> None:
    from peerd.tables import format_status

    watch = ViewWatch([BOOT_MADDR], ME, period=2.0)
    for t in range(CONFIRM):
        watch.observe([BOOT], {BOOT: 30}, now=float(t))
    text = format_status({"peer_id": ME, "peers": [], "view": watch.status()})
    assert "WARNING:   partial view of the swarm (split brain?): this peer sees 2 peers" in text
    assert "1 re-bootstrap(s)" in text
    collector = StatusCollector()
    collector.snapshot = {"peer_id": ME, "peers": [], "view": watch.status()}
    samples = {s.name: s.value for family in collector.collect() for s in family.samples}
    assert samples["peerd_swarm_view_partial"] == 1.0 and samples["peerd_swarm_rebootstraps_total"] == 1.0
    watch.observe([BOOT, *peers(28)], {BOOT: 30}, now=100.0)
    assert "partial view" not in format_status({"peer_id": ME, "peers": [], "view": watch.status()})
