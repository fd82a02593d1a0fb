"""Abuse through streams, with two real p2pd daemons: a peer that opens many streams, announces large frames
and sends them slowly, or opens streams and says nothing. With the limits, what it makes us hold stays within
swarm.streams and an honest caller is still served at once; without them (limits raised out of the way) the
same attack has us hold every byte it sends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from peerd.config import StreamLimits
from peerd.errors import MembershipError
from peerd.wire.frames import read_frame, write_frame
from peerd.wire.guard import StreamGuard
from peerd.wire.membership import Membership
from tests.helpers import p2p_daemons

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HANDLER = "peerd.v1.test.frames"
FRAME = 4 << 20  # what the attacker announces per stream
SENT = FRAME - 1  # ... and sends all of but the last byte, then holds the stream
STREAMS = 12
MiB = 1 << 20
TIGHT = StreamLimits(handshake_timeout=2.0, unproven_handshake_timeout=2.0, max_streams_per_peer=8, max_streams=64,
                     max_pending_bytes_per_peer=12 * MiB, max_pending_bytes=64 * MiB)
LOOSE = StreamLimits(handshake_timeout=2.0, max_streams_per_peer=1000, max_streams=1000,
                     max_pending_bytes_per_peer=1 << 40, max_pending_bytes=1 << 40)


async def _with_peers(limits: StreamLimits, body: Callable[[StreamGuard, StreamGuard, StreamGuard], Awaitable[Any]]
                      ) -> Any:
    async with p2p_daemons(3) as (server, *others):
        guard = StreamGuard(server, Membership(), limits)

        async def echo_size(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # as a protocol does: one frame of at most 64 MiB, answered with its size
            data = await read_frame(reader, 64 * MiB, str(info.peer_id), "test frame")
            await write_frame(writer, len(data).to_bytes(8, "little"))

        await guard.add_handler(HANDLER, echo_size)
        attacker, honest = (StreamGuard(p, Membership(), StreamLimits()) for p in others)
        return await body(guard, attacker, honest)


async def _flood(attacker: StreamGuard, target: str) -> list[asyncio.StreamWriter]:
    """Opens STREAMS streams, announces a FRAME-byte frame on each and sends SENT bytes of it; returns the
    writers, still open."""
    writers = []
    for _ in range(STREAMS):
        try:
            _, writer = await attacker.open(target, HANDLER)
        except MembershipError:  # refused as busy: the limit at work
            continue
        writer.write(FRAME.to_bytes(8, "little"))
        writer.write(bytes(SENT))
        try:
            await asyncio.wait_for(writer.drain(), 5)
        except (ConnectionError, TimeoutError):
            pass  # the target stopped reading this stream: the limit at work
        writers.append(writer)
    return writers


async def _served_in(honest: StreamGuard, target: str) -> float:
    started = time.monotonic()
    reader, writer = await honest.open(target, HANDLER)
    await write_frame(writer, b"x" * 1000)
    answer = await asyncio.wait_for(read_frame(reader, 8, target, "answer"), 20)
    writer.close()
    assert int.from_bytes(answer, "little") == 1000
    return time.monotonic() - started


async def _peaks(guard: StreamGuard, seconds: float) -> tuple[int, int]:
    """The most bytes in flight and streams open seen over ``seconds``."""
    pending = streams = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pending, streams = max(pending, guard.slots.shared.used), max(streams, guard.slots.streams)
        await asyncio.sleep(0.05)  # sampling gauges, not waiting for an event
    return pending, streams


@pytest.mark.parametrize("limits", [TIGHT, LOOSE], ids=["limits", "no-limits"])
def test_a_flood_of_slow_large_frames_is_bounded(limits: StreamLimits) -> None:
    async def body(guard: StreamGuard, attacker: StreamGuard, honest: StreamGuard) -> None:
        flood = asyncio.ensure_future(_flood(attacker, guard.peer_id))
        peak, streams = await _peaks(guard, 3.0)
        writers = await flood
        took = await _served_in(honest, guard.peer_id)
        status = guard.status()
        for writer in writers:
            writer.close()
        print(f"limits={limits.max_pending_bytes_per_peer}: peak pending {peak / MiB:.1f} MiB in {streams} streams, "
              f"honest call {took * 1000:.0f} ms, refused {status['streams_refused']}")
        assert took < 10  # honest work goes on either way: the attacker only holds its own streams
        if limits is TIGHT:
            assert peak <= limits.max_pending_bytes_per_peer and streams <= limits.max_streams_per_peer
        else:  # the same attack without the bounds: every announced frame is held at once
            assert peak >= STREAMS * FRAME

    asyncio.run(_with_peers(limits, body))


def test_silent_streams_are_closed_after_the_handshake_timeout() -> None:
    async def body(guard: StreamGuard, attacker: StreamGuard, honest: StreamGuard) -> None:
        from hivemind.p2p import PeerID

        held = [await attacker.p2p.call_binary_stream_handler(PeerID.from_base58(guard.peer_id), HANDLER)
                for _ in range(TIGHT.max_streams_per_peer)]  # raw streams: no Hello, nothing at all
        most = 0

        async def all_closed() -> None:
            nonlocal most
            while guard.unproven.streams or sum(guard.status()["streams_refused"].values()) < len(held):
                most = max(most, guard.unproven.streams)
                assert guard.slots.streams == 0  # a peer that proved nothing holds no member's slot
                await asyncio.sleep(0.05)  # polling the guard's counters

        await asyncio.wait_for(all_closed(), TIGHT.unproven_handshake_timeout + 10)
        # the unproven pool's per-peer bound held them; the rest were refused as busy at once
        refused = guard.status()["streams_refused"]
        assert most <= TIGHT.max_unproven_streams_per_peer and refused["malformed"] == most, (most, refused)
        assert await _served_in(honest, guard.peer_id) < 10
        for _, _, writer in held:
            writer.close()

    asyncio.run(_with_peers(TIGHT, body))
