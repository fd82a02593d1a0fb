"""A member's side of a span's verification, on the stream its contribution went out on (sender.py): it takes the
reducer's statement, sends its seed share and its samples of every span of the round as each is ready (every
member needs every other's of each span, and this stream is how they reach the reducer at its end), waits for
the verdict (round.py) and, if the span failed its checks, challenges the reducer: it asks for the rows of one
chunk, reads them (or the silence) and judges them (``judge``). A challenge is also drawn by chance to audit a
span that passed (audits.py): it is made after the round, on the same stream."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from peerd.averaging.group import RoundReport
from peerd.averaging.layout import max_payload_bytes
from peerd.averaging.verify.disputes import judge_chunk, output_signed
from peerd.averaging.verify.proofs import bad_reduction, false_samples
from peerd.averaging.verify.round import RoundVerification
from peerd.averaging.verify.streams import read_verify, write_verify
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire.frames import frame_size, read_frame

__all__ = ["challenge", "check_span", "judge"]

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
    sending = asyncio.ensure_future(_send_checks(v, writer, report))
    try:
        verdict = await v.verdict(span)
        sent = await sending
    except BaseException:
        sending.cancel()
        raise
    # the stream stays open until the reducer holds our samples, which other members' verdicts need
    await _confirmed(v, span, member, reader, report, sent)
    if verdict.challenge is None:
        return False
    if verdict.apply:
        return True
    sent, received = await challenge(v, span, member, chunks, reader, writer, verdict.challenge)
    report.check_bytes_sent += sent
    report.check_bytes_received += received
    return False


async def _send_checks(v: RoundVerification, writer: asyncio.StreamWriter, report: RoundReport) -> int:
    """Writes this member's seed share and samples of every span as each is ready (shares first: the others'
    samples wait for them); returns how many samples messages went out."""
    shares = {asyncio.ensure_future(v.reveal(s)): s for s in range(len(v.spans))}  # shielded futures already
    samples = {asyncio.ensure_future(v.my_samples(s)): s for s in range(len(v.spans))}
    pending: set[asyncio.Future[Any]] = set(shares) | set(samples)
    count = 0
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: t in samples):
                if task in shares:
                    share = pb.SeedShare(span_index=shares[task], share=task.result())
                    report.check_bytes_sent += await write_verify(writer, pb.VerifyMessage(share=share))
                elif (signed := task.result()) is not None:
                    report.check_bytes_sent += await write_verify(writer, pb.VerifyMessage(samples=signed))
                    count += 1
    finally:
        for task in pending:
            task.cancel()
    return count


async def _confirmed(v: RoundVerification, span: int, member: str, reader: asyncio.StreamReader,
                     report: RoundReport, count: int) -> None:
    """Until the reducer says it read our ``count`` samples messages, which other members' verdicts need: p2pd
    resets a stream whose writer closes it, and over QUIC the reset drops what is still in flight. A reducer that
    never says so (or says something else) is only waited for; its span's verdict does not depend on it."""
    for _ in range(count):
        try:
            message = await read_verify(reader, member, v.config.verification.timeout, report)
        except (ProtocolViolation, TimeoutError, ConnectionError, OSError) as e:
            logger.info("Round %s: %s did not confirm our samples for span %d: %s", v.group.round_id, member, span,
                        e)
            return
        if message.WhichOneof("body") != "received":
            logger.info("Round %s: %s sent %s where it confirms our samples for span %d", v.group.round_id, member,
                        message.WhichOneof("body"), span)
            return


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
    await judge(v, span, index, rows)
    return sent, received


async def judge(v: RoundVerification, span: int, index: int, rows: dict[int, bytes] | None) -> None:
    """Decides who lied about chunk ``index`` of span ``span`` from the rows its reducer revealed (None: it did not
    answer) and accuses them (``v.accuse(peer, reason, evidence, proven)``)."""
    statement = v.statements[span]
    reducer = statement.reducer
    out, signature, _ = v.outputs[span][index]
    signed = output_signed(statement, index, out, signature, v.keys)
    if rows is None:
        v.accuse(reducer, f"did not reveal the rows of chunk {index} of its span when challenged", None, False)
        return
    held = v.samples.get(span, {})
    by_rank = {v.group.rank_of(m): s for m, s in held.items()}
    judgment = await asyncio.to_thread(judge_chunk, statement, index, v.group, rows, out if signed else None,
                                       by_rank, v.config, v.keys)
    for member, why in judgment.members.items():
        rank = v.group.rank_of(member)
        v.accuse(member, why, false_samples(statement, index, held[member], rank, rows[rank]), True)
    if judgment.reducer is not None:
        v.accuse(reducer, judgment.reducer, bad_reduction(statement, index, out, signature, rows), True)
    elif judgment.unanswered is not None:
        v.accuse(reducer, judgment.unanswered, None, False)
    elif not signed:
        v.accuse(reducer, f"sent an average of chunk {index} its own signature does not cover", None, False)
