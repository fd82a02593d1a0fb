"""Asking a donor for its manifest alone (:func:`probe_state`), and reading a donor's answer, shared with the
downloader (:mod:`.download`)."""

from __future__ import annotations

import asyncio

from google.protobuf.message import DecodeError

from peerd.errors import ProtocolViolation, StateError
from peerd.proto import peerd_training_pb2 as pb
from peerd.training.transfer.manifest import (
    HANDLER_NAME,
    MAX_MANIFEST_BYTES,
    PROTOCOL_VERSION,
    STALL_TIMEOUT,
    Manifest,
    check_manifest,
)
from peerd.wire.frames import read_frame, write_message
from peerd.wire.guard import StreamGuard

__all__ = ["probe_state", "read_response"]


async def probe_state(guard: StreamGuard, peer: str, fingerprint: str, max_bytes: int,
                      timeout: float = STALL_TIMEOUT) -> Manifest:
    """A donor's manifest without its payload (its step and layout, checked on their own terms only)."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await guard.open(peer, HANDLER_NAME)
            try:
                await write_message(writer, pb.StateRequest(protocol_version=PROTOCOL_VERSION,
                                                            fingerprint=fingerprint, manifest_only=True))
                return check_manifest(await read_response(reader, peer, MAX_MANIFEST_BYTES), peer, max_bytes)
            finally:
                writer.close()
    except TimeoutError as e:
        raise StateError(f"{peer} sent no state manifest within {timeout:.0f}s", source=peer) from e
    except (StateError, ProtocolViolation):
        raise
    except Exception as e:  # a network boundary, as in the downloader's _try
        raise StateError(f"asking {peer} for its state failed: {type(e).__name__}: {e}", source=peer) from e


async def read_response(reader: asyncio.StreamReader, peer: str, limit: int) -> pb.StateResponse:
    data = await read_frame(reader, limit, peer, "state manifest")
    try:
        response: pb.StateResponse = pb.StateResponse.FromString(data)  # protobuf's runtime is untyped
    except DecodeError as e:
        raise ProtocolViolation(f"{peer} sent a malformed state manifest: {e}", peer_id=peer) from e
    if response.code != pb.STATE_OK:
        code = pb.StateCode.Name(response.code) if response.code in pb.StateCode.values() else str(response.code)
        raise StateError(f"{peer} has no state for us: {code} {response.message[:300]}", source=peer)
    return response
