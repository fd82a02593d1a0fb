"""State transfer between real p2pd daemons, over each libp2p transport peerd supports: a joiner gets a donor's
tensors intact, every refusal reaches it as a StateError naming the donor, a donor that disappears mid-transfer
is replaced by the next one, which continues from the byte where the first stopped, and a hostile manifest is
refused before a byte of its payload is read.

Over QUIC, a server that closes its stream right after its last write loses what p2pd had not sent yet, every
time (over TCP rarely): these tests are what keeps the server waiting for the joiner to close first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import torch
from hivemind.p2p import P2P

from peerd.config import StreamLimits
from peerd.errors import StateError
from peerd.proto import peerd_training_pb2 as pb
from peerd.training.state import TrainingState, template_of
from peerd.training.transfer.download import StateDownloader
from peerd.training.transfer.manifest import HANDLER_NAME, encode_manifest
from peerd.training.transfer.server import StateServer
from peerd.wire.frames import read_message, wait_for_close, write_frame, write_message
from peerd.wire.guard import StreamGuard
from peerd.wire.membership import Membership
from tests.helpers import LISTEN, identical, mixed_state, p2p_daemons, serving
from tests.unit.state_streams import PausingGuard

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FINGERPRINT = "fp-test"
OPEN = Membership()


def large_state() -> TrainingState:
    """~7.4 MiB in several tensors and dtypes: many yamux windows, the tail is what a hasty close would lose."""
    return mixed_state(17, rows=1024)


TEMPLATE = template_of(large_state())
TOTAL = large_state().nbytes


def guard(p2p: P2P) -> StreamGuard:
    return StreamGuard(p2p, OPEN, StreamLimits())


@asynccontextmanager
async def peers(listen: str, donors: int) -> AsyncIterator[tuple[P2P, list[P2P]]]:
    """A joiner connected to ``donors`` donors (which know nothing of each other); all shut down at the end."""
    async with p2p_daemons(donors + 1, listen) as (joiner, *donor_p2ps):
        yield joiner, donor_p2ps


@pytest.mark.parametrize("transport", LISTEN)
def test_a_large_state_arrives_intact_every_time(transport: str) -> None:
    state = large_state()
    assert TOTAL > 6 << 20

    async def body() -> None:
        async with peers(LISTEN[transport], donors=1) as (joiner, (donor,)):
            server = StateServer(guard(donor), FINGERPRINT, serving(state))
            await server.start()
            for _ in range(3):
                downloader = StateDownloader(guard(joiner), FINGERPRINT, TEMPLATE, max_bytes=8 << 20)
                assert identical(await downloader.download([str(donor.peer_id)]), state)
                assert downloader.status()["bytes_from"] == {str(donor.peer_id): TOTAL}

    asyncio.run(body())


@pytest.mark.parametrize("transport", LISTEN)
def test_refusals_reach_the_joiner_with_their_reason(transport: str) -> None:
    serving_now: list[TrainingState | None] = [None]

    async def provider() -> TrainingState | None:
        return serving_now[0]

    async def body() -> None:
        async with peers(LISTEN[transport], donors=1) as (joiner, (donor,)):
            server = StateServer(guard(donor), FINGERPRINT, provider)
            await server.start()
            donor_id = str(donor.peer_id)

            async def download(fingerprint: str = FINGERPRINT, max_bytes: int = 8 << 20) -> TrainingState:
                return await StateDownloader(guard(joiner), fingerprint, TEMPLATE, max_bytes, rounds=1).download(
                    [donor_id])

            with pytest.raises(StateError, match="STATE_UNAVAILABLE not training") as unavailable:
                await download()
            assert donor_id in str(unavailable.value) and unavailable.value.source == donor_id

            serving_now[0] = large_state()
            with pytest.raises(StateError, match="STATE_FINGERPRINT_MISMATCH this peer trains fingerprint fp-test"):
                await download("fp-other")
            with pytest.raises(StateError, match=rf"offers {TOTAL} bytes of state, above training.max_state_bytes"):
                await download(max_bytes=1 << 20)
            server.max_transfers = 0
            with pytest.raises(StateError, match="STATE_BUSY already serving 0 transfers"):
                await download()
            server.max_transfers = 4
            assert identical(await download(), large_state())

    asyncio.run(body())


@pytest.mark.parametrize("transport", LISTEN)
def test_a_donor_that_disappears_mid_transfer_is_replaced_by_the_next_which_resumes(transport: str) -> None:
    state = large_state()

    async def body() -> None:
        async with peers(LISTEN[transport], donors=2) as (joiner, (first, second)):
            for donor in (first, second):
                await StateServer(guard(donor), FINGERPRINT, serving(state)).start()
            first_id, second_id = str(first.peer_id), str(second.peer_id)
            pausing = PausingGuard(guard(joiner), first_id, after=2 << 20)
            downloader = StateDownloader(pausing.as_guard(), FINGERPRINT, TEMPLATE, max_bytes=8 << 20,
                                         stall_timeout=10.0)
            task = asyncio.create_task(downloader.download([first_id, second_id]))
            try:
                await pausing.paused.wait()  # 2 MiB of the first donor's chunks are in
                await first.shutdown()
                pausing.resume.set()
                assert identical(await task, state)
            finally:
                task.cancel()
            got = downloader.status()["bytes_from"]
            assert got[first_id] >= 1 << 20 and 0 < got[second_id] < TOTAL
            assert got[first_id] + got[second_id] == TOTAL  # not a byte twice

    asyncio.run(body())


def manifest_variant(how: str) -> pb.StateResponse:
    state = large_state()
    if how == "wrong shape":
        state.tensors["model/w"] = torch.zeros(1024, 1023)
    elif how == "wrong dtype":
        state.tensors["outer/momentum"] = state.tensors["outer/momentum"].half()
    return encode_manifest(state, 1 << 20)


@pytest.mark.parametrize("transport", ["tcp"])
def test_a_hostile_manifest_is_refused_before_its_payload(transport: str) -> None:
    cases = {
        "wrong shape": r"offers tensor model/w as torch.float32 \(1024, 1023\), this peer has .*\(1024, 1024\)",
        "wrong dtype": "offers tensor outer/momentum as torch.float16",
        "oversized": rf"offers {TOTAL} bytes of state, above training.max_state_bytes \(4194304\)",
    }
    how = ["?"]

    async def hostile(info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_message(reader, pb.StateRequest, "joiner")
        await write_message(writer, manifest_variant(how[0]))
        try:
            for _ in range(8):  # and then a payload, which must never be read
                await write_frame(writer, bytes(1 << 20))
        except (ConnectionError, OSError):
            pass
        await wait_for_close(reader, timeout=30)

    async def body() -> None:
        async with peers(LISTEN[transport], donors=1) as (joiner, (donor,)):
            await guard(donor).add_handler(HANDLER_NAME, hostile)
            donor_id = str(donor.peer_id)
            for case, match in cases.items():
                how[0] = case
                counting = PausingGuard(guard(joiner), donor_id, after=1 << 40)
                max_bytes = 4 << 20 if case == "oversized" else 8 << 20
                with pytest.raises(StateError, match=match):
                    await StateDownloader(counting.as_guard(), FINGERPRINT, TEMPLATE, max_bytes, rounds=1).download(
                        [donor_id])
                assert counting.received == 8 + len(manifest_variant(case).SerializeToString())

    asyncio.run(body())
