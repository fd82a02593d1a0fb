"""State transfer for late joiners: every trainer serves its current state; a joiner downloads and validates it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from peerd.errors import ProtocolViolation, StateError
from peerd.proto import peerd_training_pb2 as pb
from peerd.wire.frames import read_frame, read_message, wait_for_close, write_frame, write_message
from peerd.wire.guard import StreamGuard

logger = logging.getLogger(__name__)

HANDLER_NAME = "peerd.v1.training.state"
# How long a server waits for the joiner to finish reading before it closes anyway: what p2pd still holds
# (a yamux window and socket buffers, ~1 MB) takes seconds on a slow link. Longer than wire.LINGER_TIMEOUT,
# which covers a refusal of a few bytes.
JOINER_READ_TIMEOUT = 30.0
REQUEST_TIMEOUT = 10.0  # for the joiner's request, which is sent right after the handshake

# Returns (step, state bytes), or None while there is nothing to serve.
StateProvider = Callable[[], Awaitable[tuple[int, bytes] | None]]


class StateServer:
    def __init__(self, guard: StreamGuard, fingerprint: str, provider: StateProvider) -> None:
        """``guard``: only members that passed the membership handshake reach :meth:`_handle`."""
        self.guard = guard
        self.fingerprint = fingerprint
        self.provider = provider

    async def start(self) -> None:
        await self.guard.add_handler(HANDLER_NAME, self._handle)

    async def stop(self) -> None:
        await self.guard.remove_handler(HANDLER_NAME)

    async def _handle(self, info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(getattr(info, "peer_id", "?"))
        try:
            await self._answer(reader, writer, peer)
            # The requester closes once it has read everything. Closing first, right after the last write, loses
            # the tail inside p2pd: over QUIC every time, over TCP in 2 of ~500 transfers of the bench's p2pd
            # row under load; a joiner would see truncated state.
            await wait_for_close(reader, timeout=JOINER_READ_TIMEOUT, max_discard=1)
        except (ProtocolViolation, ConnectionError, OSError, TimeoutError) as e:
            logger.info("State request from %s failed: %r", peer, e)
        finally:
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        request = await asyncio.wait_for(read_message(reader, pb.StateRequest, peer), REQUEST_TIMEOUT)
        if request.fingerprint != self.fingerprint:
            await write_message(writer, pb.StateResponse(
                code=pb.STATE_FINGERPRINT_MISMATCH,
                message=f"this peer trains fingerprint {self.fingerprint}, not {request.fingerprint}",
            ))
            return
        state = await self.provider()
        if state is None:
            await write_message(writer, pb.StateResponse(code=pb.STATE_UNAVAILABLE, message="not training"))
            return
        step, blob = state
        await write_message(writer, pb.StateResponse(code=pb.STATE_OK, step=step, payload_bytes=len(blob)))
        await write_frame(writer, blob)
        logger.info("Sent training state at step %d (%d bytes) to %s", step, len(blob), peer)


async def download_state(
    guard: StreamGuard, peer_id: str, fingerprint: str, max_bytes: int, timeout: float
) -> tuple[int, bytes]:
    """Fetches (step, state bytes) from ``peer_id``; raises StateError naming the peer on any failure."""

    async def fetch() -> tuple[int, bytes]:
        reader, writer = await guard.open(peer_id, HANDLER_NAME)
        try:
            await write_message(writer, pb.StateRequest(protocol_version=1, fingerprint=fingerprint))
            response = await read_message(reader, pb.StateResponse, peer_id)
            if response.code != pb.STATE_OK:
                raise StateError(f"{peer_id} has no state for us: {pb.StateCode.Name(response.code)} "
                                 f"{response.message}", source=peer_id)
            if response.payload_bytes > max_bytes:
                raise StateError(f"{peer_id} offers {response.payload_bytes} bytes of state, above "
                                 f"training.max_state_bytes ({max_bytes})", source=peer_id)
            blob = await read_frame(reader, response.payload_bytes, peer_id, "training state")
            return int(response.step), blob
        finally:
            writer.close()

    try:
        return await asyncio.wait_for(fetch(), timeout)
    except TimeoutError as e:
        raise StateError(f"downloading state from {peer_id} timed out after {timeout:.0f}s", source=peer_id) from e
    except StateError:
        raise
    except Exception as e:  # a network boundary: hivemind's ControlFailure and friends included
        raise StateError(f"downloading state from {peer_id} failed: {type(e).__name__}: {e}", source=peer_id) from e
