"""Length-prefixed frames on a libp2p stream (opened through hivemind's P2P), with limits checked first.

hivemind's own ``P2P.receive_raw_data`` trusts the announced length; a peer could make it allocate any
amount of memory. Here every read states the most it will accept and refuses more before reading.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from peerd.errors import ProtocolViolation
from peerd.wire.limits import reserve_frame

_LENGTH_BYTES = 8
M = TypeVar("M", bound=Message)

# Protobuf headers of this protocol are tiny; anything larger is not ours.
MAX_HEADER_BYTES = 64 * 1024


# How long, and how much of its input, a refused caller gets to read our answer and close before we close.
LINGER_TIMEOUT = 2.0
LINGER_BYTES = 1 << 20


async def wait_for_close(
    reader: asyncio.StreamReader, timeout: float = LINGER_TIMEOUT, max_discard: int = LINGER_BYTES
) -> None:
    """Returns once the other side closed the stream, after ``timeout`` seconds, or after discarding
    ``max_discard`` bytes it still sent, whichever comes first; a broken stream also ends the wait.

    Whoever answers last lets the other side close first: closing a stream with input still unread resets it
    (p2pd gets ECONNRESET on its unix socket), and the reset can drop an answer still in p2pd's buffers. A
    refusal sent right after a request header, with the caller's payload still arriving, is the common case.
    Half-closing instead does not help: p2pd then closes the caller's whole socket, a payload write still under
    way fails with EPIPE and asyncio drops the answer already received.
    """
    discarded = 0
    try:
        async with asyncio.timeout(timeout):
            while discarded < max_discard:
                chunk = await reader.read(min(1 << 16, max_discard - discarded))
                if not chunk:
                    return
                discarded += len(chunk)
    except (TimeoutError, ConnectionError, OSError):
        pass


async def write_frame(writer: asyncio.StreamWriter, data: bytes | bytearray | memoryview) -> int:
    return await write_frames(writer, [data])


async def write_frames(writer: asyncio.StreamWriter, frames: list[bytes | bytearray | memoryview]) -> int:
    """Several frames in one write. Each write to p2pd's socket is a syscall that wakes p2pd, a libp2p
    frame and a wake-up of the reader on the other side; a small call's header, lengths and payloads sent
    as separate writes cost several of those round trips of scheduling instead of one."""
    parts: list[bytes | bytearray | memoryview] = []
    for data in frames:
        parts += (len(data).to_bytes(_LENGTH_BYTES, "little"), data)
    transport = writer.transport
    if transport.is_closing():
        # What drain() raises once the loop has seen the loss. write() would drop the data; CPython 3.12's
        # writelines() buffers it and can leave the closed socket registered with the selector, so that the
        # next socket given its descriptor never reads (CPython gh-136234).
        raise ConnectionResetError("Connection lost")
    writer.writelines(parts)
    _pause_if_full(transport)
    await writer.drain()
    return sum(_LENGTH_BYTES + len(data) for data in frames)


def _pause_if_full(transport: asyncio.WriteTransport) -> None:
    """On CPython 3.12.0-3.12.8 and 3.13.0-3.13.1 the selector transport's writelines() never pauses the
    protocol (CPython gh-127655): drain() returns at once, and a peer that reads nothing gets every frame
    buffered here. Setting the same limits again makes any transport compare its buffer with them."""
    low, high = transport.get_write_buffer_limits()
    if transport.get_write_buffer_size() > high:
        transport.set_write_buffer_limits(high, low)


async def read_frame(reader: asyncio.StreamReader, limit: int, peer_id: str, what: str) -> bytes:
    frame = await _read(reader, limit, peer_id, what, eof_ok=False)
    assert frame is not None  # eof_ok=False raises instead of returning None
    return frame


async def read_frame_or_eof(reader: asyncio.StreamReader, limit: int, peer_id: str, what: str) -> bytes | None:
    """Like read_frame, but None when the peer closed the stream cleanly before a new frame (reused streams)."""
    return await _read(reader, limit, peer_id, what, eof_ok=True)


async def _read_length(
    reader: asyncio.StreamReader, limit: int, peer_id: str, what: str, eof_ok: bool
) -> int | None:
    try:
        length = int.from_bytes(await reader.readexactly(_LENGTH_BYTES), "little")
    except asyncio.IncompleteReadError as e:
        if eof_ok and not e.partial:
            return None
        raise ProtocolViolation(f"{peer_id} closed the stream before sending {what}", peer_id=peer_id) from e
    if length > limit:
        raise ProtocolViolation(
            f"{peer_id} announced a {length}-byte {what}, above the limit of {limit} bytes", peer_id=peer_id
        )
    return length


async def _read(reader: asyncio.StreamReader, limit: int, peer_id: str, what: str, eof_ok: bool) -> bytes | None:
    length = await _read_length(reader, limit, peer_id, what, eof_ok)
    if length is None:
        return None
    try:
        with reserve_frame(length, peer_id, what):
            return await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise ProtocolViolation(
            f"{peer_id} sent {len(e.partial)} of the {length} bytes of {what}", peer_id=peer_id
        ) from e


async def read_frame_into(
    reader: asyncio.StreamReader, into: memoryview, peer_id: str, what: str,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Reads one frame that must be exactly ``len(into)`` bytes long straight into ``into`` (a writable byte
    view), piece by piece: the frame never exists as a bytes object of its own. ``progress`` is called with
    the size of every piece as it arrives (a byte counter, a stall timer)."""
    expected = len(into)
    length = await _read_length(reader, expected, peer_id, what, eof_ok=False)
    if length != expected:
        raise ProtocolViolation(f"{peer_id} sent a {length}-byte {what}, not the {expected} bytes asked for",
                                peer_id=peer_id)
    done = 0
    while done < expected:
        piece = await reader.read(min(expected - done, 1 << 18))
        if not piece:
            raise ProtocolViolation(f"{peer_id} sent {done} of the {expected} bytes of {what}", peer_id=peer_id)
        into[done : done + len(piece)] = piece
        done += len(piece)
        if progress is not None:
            progress(len(piece))


async def skip_frame(reader: asyncio.StreamReader, limit: int, peer_id: str, what: str) -> None:
    """Reads one frame of at most ``limit`` bytes and drops it piece by piece, never holding more than 64 KiB:
    for payloads of a refused request, read only so that the refusal reaches the sender."""
    length = await _read_length(reader, limit, peer_id, what, eof_ok=False) or 0
    left = length
    while left:
        piece = await reader.read(min(left, 1 << 16))
        if not piece:
            raise ProtocolViolation(f"{peer_id} sent {length - left} of the {length} bytes of {what}",
                                    peer_id=peer_id)
        left -= len(piece)


async def write_message(writer: asyncio.StreamWriter, message: Message) -> int:
    return await write_frame(writer, message.SerializeToString())


async def read_message(reader: asyncio.StreamReader, message_type: type[M], peer_id: str) -> M:
    data = await read_frame(reader, MAX_HEADER_BYTES, peer_id, message_type.__name__)
    try:
        message: M = message_type.FromString(data)  # protobuf's runtime is untyped
        return message
    except DecodeError as e:
        raise ProtocolViolation(
            f"{peer_id} sent a malformed {message_type.__name__}: {e}", peer_id=peer_id
        ) from e


def frame_size(payload_bytes: int) -> int:
    return _LENGTH_BYTES + payload_bytes
