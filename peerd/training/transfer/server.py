"""State transfer for late joiners, the donor's side: every trainer serves its current state in chunks.

A request gets a manifest (:mod:`peerd.training.transfer.manifest`), then the tensors' bytes in frames of at most
``chunk_bytes``, straight from the state the provider returned: no blob is built. Concurrent requests share
one snapshot (one provider call while any transfer of it runs), so serving costs at most one extra copy of the
state however many joiners there are, and at most ``max_transfers`` run at once; more are told STATE_BUSY. A
joiner that names a resume point of the same step and layout continues from there. The joiner side is
:mod:`peerd.training.transfer.download`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from peerd.errors import ProtocolViolation
from peerd.proto import peerd_training_pb2 as pb
from peerd.training.state import TrainingState
from peerd.training.transfer.manifest import (
    CHUNK_BYTES,
    HANDLER_NAME,
    PROTOCOL_VERSION,
    STALL_TIMEOUT,
    byte_view,
    chunks,
    encode_manifest,
    resume_key,
)
from peerd.wire.frames import read_message, wait_for_close, write_frame, write_message
from peerd.wire.guard import StreamGuard

__all__ = ["HANDLER_NAME", "StateProvider", "StateServer"]

logger = logging.getLogger(__name__)

# How long a server waits for the joiner to finish reading before it closes anyway: what p2pd still holds
# (a yamux window and socket buffers, ~1 MB) takes seconds on a slow link. Longer than wire.LINGER_TIMEOUT,
# which covers a refusal of a few bytes.
JOINER_READ_TIMEOUT = 30.0
REQUEST_TIMEOUT = 10.0  # for the joiner's request, which is sent right after the handshake
MAX_TRANSFERS = 4

# Returns the state to serve, or None while there is nothing to serve. The server reads the tensors until
# the last transfer that uses them ends, so they must not change meanwhile: return a copy.
StateProvider = Callable[[], Awaitable[TrainingState | None]]


@dataclass
class _Snapshot:
    state: TrainingState
    manifest: pb.StateResponse
    digest: bytes  # what a resume point must name (manifest.resume_key)
    views: list[memoryview]  # each tensor's bytes, in manifest order
    users: int = 0


class StateServer:
    def __init__(self, guard: StreamGuard, fingerprint: str, provider: StateProvider, *,
                 max_transfers: int = MAX_TRANSFERS, chunk_bytes: int = CHUNK_BYTES,
                 stall_timeout: float = STALL_TIMEOUT) -> None:
        """``guard``: only members that passed the membership handshake reach :meth:`_handle`."""
        self.guard = guard
        self.fingerprint = fingerprint
        self.provider = provider
        self.max_transfers = max_transfers
        self.chunk_bytes = chunk_bytes
        self.stall_timeout = stall_timeout
        self.active = 0
        self.served = 0  # transfers completed
        self.bytes_sent = 0
        self._snapshot: _Snapshot | None = None
        self._snapshot_lock = asyncio.Lock()

    async def start(self) -> None:
        await self.guard.add_handler(HANDLER_NAME, self._handle)

    async def stop(self) -> None:
        await self.guard.remove_handler(HANDLER_NAME)

    def status(self) -> dict[str, Any]:
        return {"transfers_active": self.active, "transfers_served": self.served, "bytes_sent": self.bytes_sent,
                "snapshot_step": self._snapshot.state.step if self._snapshot is not None else None}

    async def _handle(self, info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str(getattr(info, "peer_id", "?"))
        try:
            await self._answer(reader, writer, peer)
            # The requester closes once it has read everything. Closing first, right after the last write, loses
            # the tail inside p2pd (over QUIC every time, over TCP now and then under load): a joiner would see
            # truncated state.
            await wait_for_close(reader, timeout=JOINER_READ_TIMEOUT, max_discard=1)
        except (ProtocolViolation, ConnectionError, OSError) as e:
            logger.info("State request from %s failed: %r", peer, e)
        except TimeoutError:
            logger.info("State transfer to %s given up: it read nothing for %.0fs", peer, self.stall_timeout)
        finally:
            writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
        try:
            request = await asyncio.wait_for(read_message(reader, pb.StateRequest, peer), REQUEST_TIMEOUT)
        except TimeoutError as e:
            raise ProtocolViolation(f"{peer} sent no request within {REQUEST_TIMEOUT:.0f}s", peer_id=peer) from e
        if request.protocol_version != PROTOCOL_VERSION:
            await _refuse(writer, pb.STATE_VERSION_MISMATCH, f"this peer speaks state protocol version "
                          f"{PROTOCOL_VERSION}, not {request.protocol_version}")
            return
        if request.fingerprint != self.fingerprint:
            await _refuse(writer, pb.STATE_FINGERPRINT_MISMATCH,
                          f"this peer trains fingerprint {self.fingerprint}, not {request.fingerprint[:80]}")
            return
        if self.active >= self.max_transfers:
            await _refuse(writer, pb.STATE_BUSY, f"already serving {self.active} transfers")
            return
        self.active += 1
        try:
            snapshot = await self._acquire()
            if isinstance(snapshot, str):
                await _refuse(writer, pb.STATE_UNAVAILABLE, snapshot)
                return
            try:
                await self._send(snapshot, request, writer, peer)
            finally:
                self._release(snapshot)
        finally:
            self.active -= 1

    async def _acquire(self) -> _Snapshot | str:
        """The snapshot transfers share, taken from the provider if none is in use; else why there is none."""
        async with self._snapshot_lock:
            if self._snapshot is None:
                try:
                    state = await self.provider()
                except Exception as e:
                    logger.exception("The training state provider failed")
                    return f"could not snapshot its state: {type(e).__name__}"
                if state is None:
                    return "not training"
                try:
                    manifest = encode_manifest(state, self.chunk_bytes)
                except ValueError as e:
                    logger.error("Cannot serve the training state: %s", e)
                    return f"cannot serve its state: {e}"
                views = [byte_view(t) for t in state.tensors.values()]
                self._snapshot = _Snapshot(state, manifest, resume_key(state), views)
            self._snapshot.users += 1
            return self._snapshot

    def _release(self, snapshot: _Snapshot) -> None:
        snapshot.users -= 1
        if snapshot.users == 0 and self._snapshot is snapshot:
            self._snapshot = None  # the next request takes a fresh one from the provider

    async def _send(self, snapshot: _Snapshot, request: pb.StateRequest, writer: asyncio.StreamWriter,
                    peer: str) -> None:
        step, sizes = snapshot.state.step, [len(v) for v in snapshot.views]
        start = (0, 0)
        if request.HasField("resume"):
            resume = request.resume
            if (resume.step == step and resume.layout == snapshot.digest and resume.tensor < len(sizes)
                    and resume.offset < sizes[resume.tensor]):
                start = (resume.tensor, resume.offset)
            else:
                logger.info("%s asked to resume a download of step %d; this peer serves step %d%s: restarting "
                            "from zero", peer, resume.step, step,
                            "" if resume.layout == snapshot.digest else " with other contents")
        manifest = pb.StateResponse()
        manifest.CopyFrom(snapshot.manifest)
        manifest.start_tensor, manifest.start_offset = start
        await write_message(writer, manifest)
        if request.manifest_only:
            return
        began, sent = time.monotonic(), 0
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.stall_timeout) as stall:
            for index, offset, length in chunks(tuple(sizes), start, self.chunk_bytes):
                await write_frame(writer, snapshot.views[index][offset : offset + length])
                sent += length
                self.bytes_sent += length
                stall.reschedule(loop.time() + self.stall_timeout)
        self.served += 1
        seconds = time.monotonic() - began
        total = sum(sizes)
        resumed = f" (resumed at byte {total - sent})" if sent < total else ""
        logger.info("Sent training state at step %d to %s: %d of its %d bytes%s in %.1fs (%.1f Mbit/s)", step,
                    peer, sent, total, resumed, seconds, sent * 8 / 1e6 / max(seconds, 1e-6))


async def _refuse(writer: asyncio.StreamWriter, code: pb.StateCode, message: str) -> None:
    await write_message(writer, pb.StateResponse(code=code, message=message, protocol_version=PROTOCOL_VERSION))
