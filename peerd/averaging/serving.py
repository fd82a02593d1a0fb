"""A reducer's side of one sender's stream: the request checked, the sender's chunks read (each hashed, then
added) while the averages go back, the sender's seal, the reducer's statement after the last average, then the
span's verification (verify/record.py)."""

from __future__ import annotations

import asyncio
import functools
import logging

import torch

from peerd.averaging.compute import run_chunk_work
from peerd.averaging.layout import max_payload_bytes
from peerd.averaging.reducer import SpanReducer
from peerd.averaging.requests import check_request
from peerd.averaging.robust import WINDOW
from peerd.averaging.verify.streams import read_verify, write_verify
from peerd.errors import CodecError, ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire.frames import LINGER_BYTES, frame_size, read_frame, wait_for_close, write_frames

__all__ = ["SenderStream"]

logger = logging.getLogger(__name__)


class SenderStream:
    def __init__(self, reducer: SpanReducer, sender: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.reducer, self.sender, self.reader, self.writer = reducer, sender, reader, writer

    async def run(self, request: pb.ReduceRequest) -> None:
        r, sender, reader = self.reducer, self.sender, self.reader
        checks = pb.ReduceRequest(credentials=request.credentials, seed_commitments=request.seed_commitments).ByteSize()
        r.bytes_received += frame_size(request.ByteSize()) - checks
        r.check_bytes_received += checks
        problem = check_request(r.view, sender, request, set(r.excluded) | r.serving)
        if problem is None:
            try:
                r.record.request(sender, request)
            except ProtocolViolation as e:  # credentials that do not check out
                problem = pb.BAD_REQUEST, e.message
        if problem is not None:
            code, message = problem
            if code == pb.BAD_REQUEST:  # a member that sends nonsense is not waited for
                r.exclude(sender, message)
            await self._send(pb.ReduceResponse(code=code, message=message[:300]))
            await wait_for_close(reader)  # its chunks may follow the request: closing now could drop the refusal
            return
        r.serving.add(sender)
        if r.robust is not None:
            r.robust.claims[sender] = request.weight
        answers = asyncio.ensure_future(self._answer())
        intact = True
        try:
            await self._receive(request.weight)
        except (ProtocolViolation, CodecError, ConnectionError, OSError, TimeoutError) as e:
            r.exclude(sender, str(e))
            intact = False
        finally:
            r.record.unsealed(sender)  # a no-op once sealed
        await answers
        if intact:
            try:
                await r.record.serve(sender, reader, self.writer)
            except (ProtocolViolation, ConnectionError, OSError, TimeoutError) as e:
                logger.info("Round %s: verification with %s on span %d ended: %s", r.group.round_id, sender,
                            r.rank, e)
        # Let the sender close the stream: closing it from here could cut averages still in flight in p2pd's
        # buffers on a slow link (over QUIC, closing with input unread drops them every time). One excluded
        # mid-stream (an oversized or undecodable chunk) may still have the rest of its chunks on the way, which
        # are read and dropped.
        await wait_for_close(reader, r.config.join_timeout, max_discard=1 if intact else LINGER_BYTES)

    async def _receive(self, weight: float) -> None:
        """The sender's chunks, then its seal. Chunks after it was excluded (too slow) are still read and
        hashed: its seal covers them, and without it the chunks it is in are void."""
        r, sender = self.reducer, self.sender
        scratch = torch.empty(min(r.numel, r.config.chunk_numel), dtype=torch.float32)
        adding: asyncio.Future[None] | None = None
        for index, (start, end) in enumerate(r.chunks):
            if r.robust is not None and index >= WINDOW and sender not in r.excluded:
                await r.ready[index - WINDOW].wait()  # bounds the decoded chunks held (robust.py)
            data = await read_frame(self.reader, max_payload_bytes(end - start), sender, f"chunk {index}")
            r.bytes_received += frame_size(len(data))
            r.record.received(sender, index, data)
            if adding is not None:
                await adding  # a large chunk decodes in a thread while the next one arrives
            if sender in r.excluded:
                continue
            adding = asyncio.ensure_future(run_chunk_work(end - start, r.add, data, sender, weight, index, scratch))
            adding.add_done_callback(functools.partial(r.added, sender=sender, index=index))
        if adding is not None:
            await adding
        message = await read_verify(self.reader, sender, r.config.verification.timeout)
        if message.WhichOneof("body") != "seal":
            raise ProtocolViolation(f"{sender} sent no seal after its last chunk", peer_id=sender)
        r.check_bytes_received += frame_size(message.ByteSize())
        r.record.seal(sender, bytes(message.seal))

    async def _answer(self) -> None:
        r, sender = self.reducer, self.sender
        try:
            for index in range(len(r.chunks)):
                await r.ready[index].wait()
                payload = r.payloads[index]
                if payload is None:  # the round was abandoned, or our own values could not be averaged
                    await self._send(pb.ReduceResponse(code=pb.INTERNAL_ERROR, message="no average"))
                    return
                response = pb.ReduceResponse(
                    code=pb.OK, chunk_index=index, contributors=len(r.included[index]),
                    total_weight=r.weights[index], included=sender in r.included[index],
                    signature=r.record.signatures[index],
                )
                await self._send(response, payload)
            statement = await r.record.statement(r.ready)
            r.check_bytes_sent += await write_verify(self.writer, pb.VerifyMessage(statement=statement))
        except (ConnectionError, OSError) as e:
            logger.info("Round %s: could not return span %d to %s: %s", r.group.round_id, r.rank, sender, e)
        finally:
            r.answered_by(sender)

    async def _send(self, response: pb.ReduceResponse, payload: bytes | bytearray | None = None) -> None:
        # One write for the response and its payload: one wake-up of p2pd, no lone tiny frame on the wire.
        frames = [response.SerializeToString()] + ([payload] if payload is not None else [])
        # not `bytes_sent += await ...`: that reads the counter before the await, and the answers to the other
        # senders, running meanwhile, would have their counts overwritten
        sent = await write_frames(self.writer, frames)
        signature = pb.ReduceResponse(signature=response.signature).ByteSize()
        self.reducer.bytes_sent += sent - signature
        self.reducer.check_bytes_sent += signature
