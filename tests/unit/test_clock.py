"""Clocks beyond what the DHT admits give one clear error; TTLs keep a margin for admitted offsets; a swarm
that stopped averaging says so (WARNING once per streak, status text, progress line, metrics)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from hivemind.dht.protocol import ValidationError as DHTValidationError

from peerd.config import SwarmConfig, load_config
from peerd.control.terminal import format_progress
from peerd.errors import BootstrapError, ClockSkewError
from peerd.metrics import StatusCollector
from peerd.swarm import bootstrap
from peerd.swarm.clock import MAX_CLOCK_OFFSET, clock_skew_error, record_lifetimes, ttl_margin_problems
from peerd.swarm.signing import key_id
from peerd.tables import format_status
from peerd.training.health import STALL_ROUNDS, AveragingHealth
from peerd.training.report import TrainingReport
from peerd.wire.membership import Membership
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(60)

PEER = "/ip4/127.0.0.1/tcp/4001/p2p/QmNzpKoQTpwQ7vprtaN3C2WcbDHhjY94zHAZR7FXXB5G5f"
LIFETIMES = record_lifetimes("run", SwarmConfig())


def refusal(local: float, peer: float) -> DHTValidationError:
    # hivemind 1.1.12, dht/protocol.py DHTProtocol.call_ping, word for word
    return DHTValidationError(f"local time must be within {int(MAX_CLOCK_OFFSET)} seconds "
                              f" of others(local: {local:.5f}, peer: {peer:.5f})")


@pytest.mark.parametrize(("local", "peer", "words"), [(1_795_511_270.4, 1_795_511_240.4, "+30.0 s"),
                                                      (1_795_511_240.4, 1_795_511_270.4, "-30.0 s")])
def test_the_refusal_names_the_measured_offset_and_the_fix_in_one_line(local: float, peer: float,
                                                                        words: str) -> None:
    error = clock_skew_error(refusal(local, peer), [PEER])
    assert isinstance(error, ClockSkewError)
    assert error.offset == pytest.approx(local - peer)
    text = str(error)
    assert "\n" not in text and words in text and PEER in text and "NTP" in text
    assert ("ahead of" if local > peer else "behind") in text


def test_other_refusals_are_not_taken_for_clock_errors() -> None:
    assert clock_skew_error(DHTValidationError("Peer X can't access this node")) is None


def test_bootstrap_turns_the_refusal_into_a_clock_error_without_retrying(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    async def refuse(*args: Any) -> None:
        calls.append(args)
        raise refusal(1_000_030.0, 1_000_000.0)

    monkeypatch.setattr(bootstrap, "start_dht", refuse)
    config = SwarmConfig(initial_peers=[PEER], bootstrap_attempts=3, bootstrap_retry_delay=0)
    with pytest.raises(ClockSkewError, match=r"clock offset \+30\.0 s"):
        asyncio.run(bootstrap.start_with_retries(config, Path("key"), True, Membership(), LIFETIMES, 0, False))
    assert len(calls) == 1

    async def unreachable(*args: Any) -> None:
        raise DHTValidationError("Peer X can't access this node. Probably, libp2p has failed to bypass the firewall")

    monkeypatch.setattr(bootstrap, "start_dht", unreachable)
    with pytest.raises(BootstrapError, match="refused this one: Peer X can't access"):
        asyncio.run(bootstrap.start_with_retries(config, Path("key"), True, Membership(), LIFETIMES, 0, False))


def test_an_initial_peer_too_busy_to_answer_a_ping_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    # hivemind raises a bare RuntimeError when no initial peer answers its bootstrap ping
    attempts = []

    async def busy_then_ready(*args: Any) -> str:
        attempts.append(args)
        if len(attempts) < 3:
            raise RuntimeError("DHTNode bootstrap failed: none of the initial_peers responded to a ping.")
        return "dht"

    monkeypatch.setattr(bootstrap, "start_dht", busy_then_ready)
    config = SwarmConfig(initial_peers=[PEER], bootstrap_attempts=3, bootstrap_retry_delay=0)
    assert asyncio.run(bootstrap.start_with_retries(config, Path("key"), True, Membership(), LIFETIMES, 0, False)) == "dht"
    attempts.clear()
    with pytest.raises(BootstrapError, match="after 2 attempts.*responded to a ping"):
        asyncio.run(bootstrap.start_with_retries(config.model_copy(update={"bootstrap_attempts": 2}), Path("key"),
                                                  True, Membership(), LIFETIMES, 0, False))


def test_ttls_shorter_than_their_refresh_plus_the_admitted_offset_are_named() -> None:
    tight = load_config(overrides={"swarm": {"record_ttl": 4, "record_refresh_period": 2},
                                   "training": {"enabled": True, "progress_ttl": 2, "progress_period": 0.5}})
    problems = ttl_margin_problems(tight)
    assert len(problems) == 2
    assert "raise swarm.record_ttl to at least 6" in problems[0]
    assert "raise training.progress_ttl to at least 4.5" in problems[1]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_leave_a_margin_for_clock_offsets(path: Path) -> None:
    assert ttl_margin_problems(load_config(path)) == []


def test_a_stall_warns_once_per_streak_and_recovery_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="peerd.training.health")
    health = AveragingHealth(grace=0.0)
    for _ in range(STALL_ROUNDS - 1):
        health.failed("group has 1 member(s)", others=1)
    assert not health.stalled and not caplog.records
    for _ in range(5):
        health.failed("registered too late", others=1)
    assert health.stalled and health.as_dict()["failed_streak"] == STALL_ROUNDS + 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Averaging has stopped" in warnings[0].getMessage()
    assert "registered too late" in warnings[0].getMessage()
    health.averaged()
    assert not health.stalled and health.as_dict()["failed_streak"] == 0
    assert caplog.records[-1].levelno == logging.INFO and "Averaging again" in caplog.records[-1].getMessage()


def test_no_stall_while_alone_or_within_the_grace() -> None:
    report = TrainingReport(fingerprint="ab" * 4, parameters=1, health=AveragingHealth(grace=3600.0))
    for _ in range(10):
        report.record_solo("group has 1 member(s)", others=1)
    assert report.rounds_solo == 10 and not report.health.stalled  # a departed peer's record still lingers
    report.health.grace = 0.0
    report.record_solo("group has 1 member(s)", others=1)
    assert report.health.stalled
    report.record_solo("no other peer is at this step", others=0)  # nobody left to average with
    assert not report.health.stalled and report.health.streak == 0


def test_a_stall_shows_in_the_status_text_the_progress_line_and_metrics() -> None:
    report = TrainingReport(fingerprint="ab" * 4, parameters=1, health=AveragingHealth(grace=0.0))
    for _ in range(STALL_ROUNDS):
        report.record_solo("group has 1 member(s), below min_group_size", others=1)
    status = {"peer_id": "me", "peers": [], "training": report.as_dict()}
    text = format_status(status)
    assert "WARNING:   averaging has stopped: 3 rounds" in text and "below min_group_size" in text
    assert "AVERAGING STOPPED" in format_progress(status["training"])
    collector = StatusCollector()
    collector.snapshot = status
    samples = {s.name: s.value for family in collector.collect() for s in family.samples}
    assert samples["peerd_averaging_stalled"] == 1.0 and samples["peerd_averaging_failed_streak"] == 3.0
    report.health.averaged()
    assert "averaging has stopped" not in format_status({**status, "training": report.as_dict()})


def test_only_the_dht_process_s_abandoned_rpc_handlers_are_filtered() -> None:
    from peerd.log import _abandoned_dht_rpc

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)

    abandoned = ("Task was destroyed but it is pending!\ntask: <Task pending name='Task-20' coro=<DHTProtocol.rpc_ping() "
                 "running at /venv/lib/python3.11/site-packages/hivemind/dht/protocol.py:144>>")
    assert not _abandoned_dht_rpc(record(abandoned))
    assert _abandoned_dht_rpc(record("Task was destroyed but it is pending!\ntask: <Task pending coro=<mine()>>"))
    assert _abandoned_dht_rpc(record("Task exception was never retrieved"))


def test_record_lifetimes_follow_each_keys_ttl_plus_the_admitted_offset() -> None:
    config = load_config(overrides={"run_name": "r", "swarm": {"record_ttl": 12, "record_refresh_period": 2},
                                    "training": {"progress_ttl": 7},
                                    "averaging": {"max_matchmaking_window": 4, "round_timeout": 15}})
    lifetimes = record_lifetimes(config.run_name, config.swarm, config.averaging, config.training, config.experts)
    assert lifetimes.cap(key_id("r.peers")) == 12 + MAX_CLOCK_OFFSET
    assert lifetimes.cap(key_id("r.progress")) == 7 + MAX_CLOCK_OFFSET
    assert lifetimes.cap(key_id("r.experts")) == 15 + MAX_CLOCK_OFFSET  # experts.record_ttl's default
    # a round key: what matchmaking stores its entries with (the diloco window, 5 s, is the longest)
    assert lifetimes.cap(key_id("r.abc.grad.7")) == 5 + 15 + 10 + 2 * MAX_CLOCK_OFFSET
