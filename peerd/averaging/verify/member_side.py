"""A member's side of a span's verification, on the stream its contribution went out on (sender.py): it takes the
reducer's statement, reveals its seed share, sends its samples, waits for the verdict (round.py) and, if the span
failed its checks, challenges the reducer: it asks for the rows of one chunk, reads them (or the silence) and has
the round judge them. A challenge is also drawn by chance to audit a span that passed (audits.py): it is made
after the round, on the same stream."""

from __future__ import annotations

import asyncio
import logging

from peerd.averaging.group import RoundReport
from peerd.averaging.layout import max_payload_bytes
from peerd.averaging.verify.round import RoundVerification
from peerd.averaging.verify.streams import read_verify, write_verify
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire.frames import frame_size, read_frame

__all__ = ["challenge", "check_span"]

logger = logging.getLogger(__name__)


async def check_span(v: RoundVerification, span: int, member: str, chunks: list[tuple[int, int]],
                     reader: asyncio.StreamReader, writer: asyncio.StreamWriter, report: RoundReport) -> bool:
    """The verification of span ``span``, whose reducer is ``member``: statement in, seed share and samples out,
    the verdict, a challenge. True if the span passed and drew an audit: what it applies is settled, so the audit
    waits for the round to end (``challenge`` then), and the round's time does not pay for a chunk's rows."""
    timeout = v.config.verification.timeout
    message = await read_verify(reader, member, timeout, report)
    if message.WhichOneof("body") != "statement":
        raise ProtocolViolation(f"{member} sent no statement of its span", peer_id=member)
    await v.statement_from(span, message.statement)
    report.check_bytes_sent += await write_verify(writer, pb.VerifyMessage(reveal=await v.reveal()))
    report.check_bytes_sent += await write_verify(writer, pb.VerifyMessage(samples=await v.my_samples()))
    # read while the verdict is drawn: the stream stays open until the reducer holds our samples
    confirmed = asyncio.ensure_future(_confirmed(v, span, member, reader, report))
    try:
        verdict = await v.verdict(span)
    except BaseException:
        confirmed.cancel()
        raise
    await confirmed
    if verdict.challenge is None:
        return False
    if verdict.apply:
        return True
    sent, received = await challenge(v, span, member, chunks, reader, writer, verdict.challenge)
    report.check_bytes_sent += sent
    report.check_bytes_received += received
    return False


async def _confirmed(v: RoundVerification, span: int, member: str, reader: asyncio.StreamReader,
                     report: RoundReport) -> None:
    """Until the reducer says it read our seed share and samples, which other members' verdicts need: p2pd resets a
    stream whose writer closes it, and over QUIC the reset drops what is still in flight. A reducer that never says
    so (or says something else) is only waited for; its span's verdict does not depend on it."""
    try:
        message = await read_verify(reader, member, v.config.verification.timeout, report)
    except (ProtocolViolation, TimeoutError, ConnectionError, OSError) as e:
        logger.info("Round %s: %s did not confirm our samples for span %d: %s", v.group.round_id, member, span, e)
        return
    if message.WhichOneof("body") != "received":
        logger.info("Round %s: %s sent %s where it confirms our samples for span %d", v.group.round_id, member,
                    message.WhichOneof("body"), span)


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
