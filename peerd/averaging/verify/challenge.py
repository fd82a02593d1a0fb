"""A member's challenge of a span's reducer, on the span's stream: it asks for the rows of one chunk, reads them
(or the silence) and has the round judge them (round.py). Drawn when the span failed its checks, or by chance to
audit one that passed (audits.py)."""

from __future__ import annotations

import asyncio
import logging

from peerd.averaging.layout import max_payload_bytes
from peerd.averaging.verify.round import RoundVerification
from peerd.averaging.verify.streams import read_verify, write_verify
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire.frames import frame_size, read_frame

__all__ = ["challenge"]

logger = logging.getLogger(__name__)


async def challenge(v: RoundVerification, span: int, member: str, chunks: list[tuple[int, int]],
                    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> tuple[int, int]:
    """Asks ``member``, the reducer of span ``span`` (cut into ``chunks``), for the rows of chunk ``index`` and
    judges them, or the silence; returns the bytes (sent, received)."""
    timeout = v.config.verification.timeout
    sent = await write_verify(writer, pb.VerifyMessage(challenge=index))
    received = 0
    rows: dict[int, bytes] | None = None
    try:
        answer = await read_verify(reader, member, 3 * timeout)
        received += frame_size(answer.ByteSize())
        if answer.WhichOneof("body") == "answer" and answer.answer.ok and answer.answer.chunk_index == index:
            a, b = chunks[index]
            rows = {}
            for rank in v.statements[span].chunks[index].included:
                async with asyncio.timeout(timeout):
                    rows[rank] = await read_frame(reader, max_payload_bytes(b - a), member, "revealed row")
                received += frame_size(len(rows[rank]))
    except (ProtocolViolation, TimeoutError, ConnectionError, OSError) as e:
        logger.warning("Round %s: %s did not answer the challenge of span %d: %s", v.group.round_id, member, span, e)
        rows = None
    await v.judge(span, index, rows)
    return sent, received
