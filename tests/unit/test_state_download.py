"""The chunked state transfer, server and downloader, over in-process socket pairs (tests/unit/state_streams.py):
resuming across donors, starting over at another step, stalls, busy donors sharing one snapshot, refreshing
candidates, and donors that send what was not asked for. The same over real p2pd: tests/integration."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from peerd.errors import StateError
from peerd.proto import peerd_training_pb2 as pb
from peerd.training.state import TrainingState, template_of
from peerd.training.transfer.download import StateDownloader
from peerd.training.transfer.manifest import HANDLER_NAME, encode_manifest
from peerd.training.transfer.server import StateServer
from peerd.wire.frames import read_message, wait_for_close, write_frame, write_message
from peerd.wire.guard import StreamGuard
from tests.helpers import Provider, identical, mixed_state, serving
from tests.unit.state_streams import LocalNet, PausingGuard

pytestmark = pytest.mark.timeout(30)

FP = "fp-test"
A, B, C, JOINER = "donor-a", "donor-b", "donor-c", "joiner"
CHUNK = 64 << 10


TEMPLATE = template_of(mixed_state())  # its model/w: 1 MiB, 16 chunks of CHUNK
TOTAL = mixed_state().nbytes


@asynccontextmanager
async def swarm(**donors: Provider | StateServer) -> AsyncIterator[LocalNet]:
    net = LocalNet()
    try:
        for peer, provider in donors.items():
            server = provider if isinstance(provider, StateServer) else StateServer(
                net.guard(peer), FP, provider, chunk_bytes=CHUNK)
            await server.start()
        yield net
    finally:
        await net.close()


def downloader(guard: StreamGuard, **options: Any) -> StateDownloader:
    return StateDownloader(guard, FP, TEMPLATE, max_bytes=1 << 30, **{"retry_delay": 0.0, **options})


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def test_a_download_resumes_from_the_next_donor_at_the_same_step(caplog: pytest.LogCaptureFixture) -> None:
    state = mixed_state()

    async def body() -> None:
        async with swarm(**{A: serving(state), B: serving(state)}) as net:
            pausing = PausingGuard(net.guard(JOINER), A, after=300_000)
            joiner = downloader(pausing.as_guard())
            task = asyncio.create_task(joiner.download([A, B]))
            await pausing.paused.wait()
            assert joiner.status()["state"] == "downloading" and joiner.status()["donor"] == A
            net.cut(A)  # the donor disappears mid-transfer
            pausing.resume.set()
            got = await task
            assert identical(got, state)
            status = joiner.status()
            assert 0 < status["bytes_from"][A] < TOTAL and status["bytes_from"][B] == TOTAL - status["bytes_from"][A]
            assert status | {"seconds": 0} == {
                "state": "done", "donor": B, "step": 11, "bytes_done": TOTAL, "bytes_total": TOTAL, "donors_tried": 2,
                "bytes_from": status["bytes_from"], "seconds": 0}

    with caplog.at_level(logging.INFO):
        run(body)
    assert f"Resuming the state download of step 11 from {B}" in caplog.text


def test_a_donor_at_another_step_restarts_from_zero(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with swarm(**{A: serving(mixed_state(11)), B: serving(mixed_state(12))}) as net:
            pausing = PausingGuard(net.guard(JOINER), A, after=300_000)
            joiner = downloader(pausing.as_guard())
            task = asyncio.create_task(joiner.download([A, B]))
            await pausing.paused.wait()
            net.cut(A)
            pausing.resume.set()
            assert identical(await task, mixed_state(12))
            assert joiner.status()["bytes_from"][B] == TOTAL

    with caplog.at_level(logging.INFO):
        run(body)
    assert f"{JOINER} asked to resume a download of step 11; this peer serves step 12: restarting" in caplog.text
    assert f"{B} serves step 12 (this peer held" in caplog.text


def test_a_silent_donor_is_abandoned_after_the_stall_timeout() -> None:
    async def silent(info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_message(reader, pb.StateRequest, "joiner")
        await write_message(writer, encode_manifest(mixed_state(), CHUNK))
        await wait_for_close(reader, timeout=30)  # sends no payload, keeps the stream open

    async def body() -> None:
        async with swarm(**{B: serving(mixed_state())}) as net:
            await net.guard(A).add_handler(HANDLER_NAME, silent)
            joiner = downloader(net.guard(JOINER), stall_timeout=0.3)
            assert identical(await joiner.download([A, B]), mixed_state())
            assert joiner.status()["bytes_from"] == {A: 0, B: TOTAL}

    run(body)


def test_concurrent_transfers_share_one_snapshot_and_the_rest_are_told_busy() -> None:
    calls = []

    async def provider() -> TrainingState:
        calls.append(1)
        return mixed_state()

    async def body() -> None:
        net = LocalNet()
        server = StateServer(net.guard(A), FP, provider, chunk_bytes=CHUNK, max_transfers=2)
        await server.start()
        try:
            pausing = PausingGuard(net.guard(JOINER), A, after=200_000)
            first = asyncio.create_task(downloader(pausing.as_guard()).download([A]))
            await pausing.paused.wait()  # the first transfer holds the snapshot
            assert identical(await downloader(net.guard("second")).download([A]), mixed_state())
            server.max_transfers = 1
            with pytest.raises(StateError, match=f"{A} has no state for us: STATE_BUSY already serving 1"):
                await downloader(net.guard("third"), rounds=1).download([A])
            pausing.resume.set()
            assert identical(await first, mixed_state())
            await net.idle()
            assert len(calls) == 1 and server.status()["snapshot_step"] is None  # released after the last one
            assert identical(await downloader(net.guard("fourth")).download([A]), mixed_state())
            assert len(calls) == 2
        finally:
            await net.close()

    run(body)


def test_refusals_name_the_donor_and_refresh_finds_another() -> None:
    async def body() -> None:
        async with swarm(**{A: serving(None), B: serving(mixed_state())}) as net:
            refreshed: list[int] = []

            async def refresh() -> list[str]:
                refreshed.append(1)
                return [B]

            joiner = downloader(net.guard(JOINER))
            assert identical(await joiner.download([A, C], refresh), mixed_state())
            assert refreshed == [1] and joiner.status()["donors_tried"] == 3

            with pytest.raises(StateError) as failed:
                await downloader(net.guard(JOINER), rounds=2).download([A, C], refresh=None)
            assert f"{A} has no state for us: STATE_UNAVAILABLE not training" in str(failed.value)
            assert f"{C}: ConnectionRefusedError" in str(failed.value) and failed.value.source == f"{A}, {C}"

            with pytest.raises(StateError, match="offers step 11; this peer needs 12 or later"):
                await downloader(net.guard(JOINER)).download([B], min_step=12)
            joiner = StateDownloader(net.guard(JOINER), "fp-other", TEMPLATE, 1 << 30, rounds=1)
            with pytest.raises(StateError, match="STATE_FINGERPRINT_MISMATCH this peer trains fingerprint fp-test"):
                await joiner.download([B])
            assert joiner.status()["state"] == "failed"

    run(body)


def test_a_state_with_nan_is_refused_and_the_next_donor_used() -> None:
    poisoned = mixed_state()
    poisoned.tensors["outer/momentum"][5] = float("nan")

    async def body() -> None:
        async with swarm(**{A: serving(poisoned), B: serving(mixed_state())}) as net:
            joiner = downloader(net.guard(JOINER))
            assert identical(await joiner.download([A, B]), mixed_state())

    run(body)


async def _lying(info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, how: str) -> None:
    await read_message(reader, pb.StateRequest, "joiner")
    state = mixed_state()
    await write_message(writer, encode_manifest(state, CHUNK, start=(0, 8) if how == "start" else (0, 0)))
    if how == "long chunk":
        await write_frame(writer, bytes(CHUNK + 1))
    await wait_for_close(reader, timeout=30)


@pytest.mark.parametrize(("how", "match"), [
    ("start", f"{A} sends state from tensor 0, offset 8, which this peer did not ask for"),
    ("long chunk", f"{A} announced a {CHUNK + 1}-byte chunk of tensor model/w, above the limit of {CHUNK} bytes"),
])
def test_a_donor_sending_what_was_not_asked_for_is_refused(how: str, match: str) -> None:
    async def body() -> None:
        async with swarm() as net:
            await net.guard(A).add_handler(HANDLER_NAME, lambda i, r, w: _lying(i, r, w, how))
            with pytest.raises(StateError, match=match):
                await downloader(net.guard(JOINER), rounds=1).download([A])

    run(body)
