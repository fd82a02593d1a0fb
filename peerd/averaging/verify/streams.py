"""Verification messages on an all-reduce stream: one VerifyMessage per frame, bounded and timed."""

from __future__ import annotations

import asyncio

from google.protobuf.message import DecodeError

from peerd.averaging.group import RoundReport
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire.frames import frame_size, read_frame_or_eof, write_frame

__all__ = ["MAX_VERIFY_BYTES", "read_verify", "read_verify_or_eof", "write_verify"]

# A statement of a 64-member group over a span of 2^26 elements in 2^19-element chunks is ~2 MB; a member's
# samples over all 64 such spans (256 values, an envelope and a sketch per chunk) ~14 MB.
MAX_VERIFY_BYTES = 16 << 20


async def write_verify(writer: asyncio.StreamWriter, message: pb.VerifyMessage) -> int:
    return await write_frame(writer, message.SerializeToString())


async def read_verify_or_eof(reader: asyncio.StreamReader, peer: str, timeout: float,
                             report: RoundReport | None = None) -> pb.VerifyMessage | None:
    """The next verification message from ``peer``, None if it closed the stream; ProtocolViolation if it is
    malformed, TimeoutError after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        data = await read_frame_or_eof(reader, MAX_VERIFY_BYTES, peer, "verification message")
    if data is None:
        return None
    if report is not None:
        report.check_bytes_received += frame_size(len(data))
    try:
        message: pb.VerifyMessage = pb.VerifyMessage.FromString(data)  # protobuf's runtime is untyped
        return message
    except DecodeError:
        raise ProtocolViolation(f"{peer} sent a malformed verification message", peer_id=peer) from None


async def read_verify(reader: asyncio.StreamReader, peer: str, timeout: float,
                      report: RoundReport | None = None) -> pb.VerifyMessage:
    message = await read_verify_or_eof(reader, peer, timeout, report)
    if message is None:
        raise ProtocolViolation(f"{peer} closed the stream before verification finished", peer_id=peer)
    return message
