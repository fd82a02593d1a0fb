"""Fewer DHT requests on a busy swarm: the latency window, the waits that scale with it, and progress records
stored only when they say something new."""

from __future__ import annotations

import asyncio
import gc
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from peerd.config import SwarmConfig, TrainingConfig
from peerd.errors import TransportError
from peerd.swarm.clock import record_lifetimes
from peerd.swarm.identity import generate_identity
from peerd.swarm.latency import LatencyWindow
from peerd.swarm.node import SwarmNode
from peerd.swarm.presence import Presence
from peerd.swarm.reach import Reachability
from peerd.swarm.signing import RecordSigner
from peerd.training.progress import ProgressTracker, progress_pause
from peerd.wire.membership import Membership

pytestmark = pytest.mark.timeout(30)


def test_the_window_keeps_the_last_requests_and_counts_a_raised_one() -> None:
    window = LatencyWindow(size=3)
    assert window.median() == 0.0 and len(window) == 0
    for seconds in (9.0, 0.1, 0.2, 0.3):  # the first falls out
        window.record(seconds)
    assert len(window) == 3 and window.median() == pytest.approx(0.2)
    with pytest.raises(TimeoutError), window.timing():
        raise TimeoutError  # a request that timed out is still a (slow) request
    assert len(window) == 3 and window.median() == pytest.approx(0.2)  # 0.2, 0.3 and ~0


def test_progress_is_exchanged_less_often_on_a_slow_dht_but_within_its_ttl() -> None:
    config = TrainingConfig(progress_period=0.5, progress_ttl=10.0)
    assert progress_pause(config, 0.01) == 0.5  # a fast DHT: the configured period
    assert progress_pause(config, 1.0) == 2.0  # 2x the median request time
    assert progress_pause(config, 5.0) == 2.5  # a quarter of the TTL at most, or the record would lapse


class _CountingSwarm:
    peer_id = "Qm" + "A" * 44

    def __init__(self) -> None:
        self.stores = 0

    async def store(self, key: str, subkey: str, payload: dict[str, Any], expiration: float) -> bool:
        self.stores += 1
        return True


def test_an_unchanged_progress_record_is_not_stored_again_until_a_quarter_of_its_ttl() -> None:
    async def scenario() -> list[int]:
        swarm = _CountingSwarm()
        tracker = ProgressTracker(swarm, "run", "0123abcd", ttl=2.0)  # type: ignore[arg-type]
        counts = []
        for step, samples in ((1, 32), (1, 32), (1, 64), (1, 64)):  # as a periodic publisher in a round sees it
            await tracker.publish(step, samples, 10.0, if_changed=True)
            counts.append(swarm.stores)
        await asyncio.sleep(0.6)  # past ttl / 4: republished although nothing changed, before it lapses
        await tracker.publish(1, 64, 10.0, if_changed=True)
        await tracker.publish(1, 64, 10.0)  # the trainer's own publications always store
        return [*counts, swarm.stores]

    assert asyncio.run(scenario()) == [1, 1, 2, 2, 4]


class _ReadingSwarm:
    """Counts reads of all records; each read waits until the test releases it."""

    peer_id = "Qm" + "B" * 44

    def __init__(self) -> None:
        self.reads = 0
        self.release = asyncio.Event()

    async def read_peers(self) -> list[Any]:
        self.reads += 1
        await self.release.wait()
        if self.fail:
            raise TransportError("reading the records timed out")
        return []

    fail = False


def test_status_and_the_view_check_share_reads_of_the_records() -> None:
    async def scenario() -> list[int]:
        swarm = _ReadingSwarm()
        presence = Presence(swarm, SwarmConfig(record_refresh_period=0.5), record=lambda: None)  # type: ignore
        counts = []
        # a status page, a metrics scrape and the view check at once: one DHT read
        waiting = [asyncio.ensure_future(presence.peers()) for _ in range(3)]
        check = asyncio.ensure_future(presence.check_view())
        await asyncio.sleep(0)
        waiting[0].cancel()  # a status request that gives up does not cancel the read the others wait on
        await asyncio.sleep(0)
        swarm.release.set()
        results = await asyncio.gather(*waiting[1:], check)
        counts.append(swarm.reads)
        assert all(result[1] is not None and result[2] is None for result in results[:2])  # age, no error
        await presence.peers()  # within a refresh period: the same read
        counts.append(swarm.reads)
        await asyncio.sleep(0.6)  # records may have changed since: a new read
        await presence.peers()
        counts.append(swarm.reads)
        return counts

    assert asyncio.run(scenario()) == [1, 1, 2]


def test_a_failed_read_nobody_waits_for_any_more_logs_nothing() -> None:
    """Every status request gave up before the shared read failed: asyncio has no "exception was never
    retrieved" to log for the failed read."""
    unretrieved: list[dict[str, Any]] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
        swarm = _ReadingSwarm()
        swarm.fail = True
        presence = Presence(swarm, SwarmConfig(record_refresh_period=0.5), record=lambda: None)  # type: ignore
        waiting = asyncio.ensure_future(presence.peers())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.sleep(0)  # the request is gone before the read ends
        swarm.release.set()
        while swarm.reads == 1 and presence._reading is not None and not presence._reading.done():
            await asyncio.sleep(0)
        del presence, waiting  # the failed read's last reference: asyncio logs then if nobody took its error
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert [context["message"] for context in unretrieved] == []


class _RecordingDHT:
    """hivemind's ``DHT`` as far as ``SwarmNode.store``/``read_entries`` call it; records the lookup options."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self.options: list[tuple[str, dict[str, Any]]] = []

    def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None, return_future: bool = False,
              **kwargs: Any) -> Future[bool]:
        self.options.append(("store", kwargs))
        return _done(True)

    def get(self, key: str, latest: bool = False, return_future: bool = False, **kwargs: Any) -> Future[None]:
        self.options.append(("get", {"latest": latest, **kwargs}))
        return _done(None)


def _done(result: Any) -> Future[Any]:
    future: Future[Any] = Future()
    future.set_result(result)
    return future


def test_every_store_and_read_asks_only_the_configured_beam_of_nodes(tmp_path: Path) -> None:
    # hivemind's lookups otherwise visit its bucket size (20) of nodes nearest the key: a third of 64 peers
    generate_identity(tmp_path / "id")
    signer = RecordSigner((tmp_path / "id").read_bytes(), Membership())
    config = SwarmConfig(lookup_beam=7)
    dht = _RecordingDHT(signer.peer_id)
    node = SwarmNode(config, "run", dht, signer, Membership(), Reachability(config, 1),  # type: ignore[arg-type]
                     record_lifetimes("run", config))

    async def scenario() -> None:
        await node.store("run.peers", signer.peer_id, {"peer_id": signer.peer_id}, 2e9)
        await node.read_entries("run.peers")

    asyncio.run(scenario())
    assert dht.options == [("store", {"beam_size": 7}), ("get", {"latest": True, "beam_size": 7})]
    with pytest.raises(ValueError, match="lookup_beam"):
        SwarmConfig(lookup_beam=4)  # fewer than the 5 nodes a key is stored on
