"""A member's side of one reducer's span: its coded contribution goes out and the coded average comes back,
chunk by chunk, on one stream (protocols/peerd_averaging.proto); then the sender seals what it sent, and the
span's verification follows on the same stream (verify/member_side.py). Chunks whose average never arrives,
or is not applied, keep this member's own values; error feedback is carried only where the reducer included a
chunk and its average is applied.

The next chunk is coded while the current one drains into p2pd, and the first one while the stream opens,
so the uplink never waits for the codec."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Collection
from dataclasses import dataclass, field

import blake3
import torch

from peerd.averaging.compute import run_chunk_work
from peerd.averaging.group import Group, RoundReport
from peerd.averaging.layout import chunk_bounds, max_payload_bytes
from peerd.averaging.requests import PROTOCOL_VERSION
from peerd.averaging.verify.member_side import challenge, check_span
from peerd.averaging.verify.payloads import block_norms, envelope, scheme_of, sent_count, view
from peerd.averaging.verify.round import RoundVerification
from peerd.averaging.verify.samples import OwnRow
from peerd.averaging.verify.statement import SEAL, seal_parts
from peerd.averaging.verify.streams import write_verify
from peerd.config import AveragingConfig, CodecConfig
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire import codec
from peerd.wire.feedback import encode_with_feedback, readd_left_out
from peerd.wire.frames import frame_size, read_frame, read_message, write_frames, write_message
from peerd.wire.guard import StreamGuard

logger = logging.getLogger(__name__)

Coded = tuple[bytearray, float, bytes, torch.Tensor, torch.Tensor]  # payload, norm, hash, envelope, block norms
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class SpanExchange:
    """Everything one member needs to exchange one reducer's span; ``run`` never raises for the reducer's faults."""

    guard: StreamGuard
    handler: str
    group: Group
    member: str  # the reducer
    span: tuple[int, int]
    flat: torch.Tensor
    weight: float
    residual: torch.Tensor | None
    result: torch.Tensor
    report: RoundReport
    config: AveragingConfig
    codec_config: CodecConfig
    verification: RoundVerification
    sent: torch.Tensor  # what every member decodes of this member's contributions, flat
    received: set[int] = field(default_factory=set)
    included: dict[int, bool] = field(default_factory=dict)  # chunks the reducer included -> average is SPARSE8
    errors: list[float] = field(default_factory=list)
    # a span that passed its checks and drew an audit: its stream, left open for `audit` after the round
    audit_stream: Stream | None = None
    # set by the round for a reducer seen absent lately that is still behind the rest of it (absences.py)
    give_up: asyncio.Event = field(default_factory=asyncio.Event)
    exchanged: asyncio.Event = field(default_factory=asyncio.Event)  # the averages are in, or never will be
    late = False  # the exchange ended for keeping this member waiting: timed out, or given up on

    def __post_init__(self) -> None:
        start, end = self.span
        self.index = self.group.rank_of(self.member)
        self.chunks = chunk_bounds(end - start, self.config.chunk_numel)
        self.source = self.flat[start:end]
        self.carried = self.residual[start:end] if self.residual is not None else None
        self.out = self.result[start:end]
        self.decoded = self.sent[start:end]
        # What quantization drops from each chunk, committed to the residual once its average is applied.
        self.dropped = torch.empty_like(self.source) if self.residual is not None else None
        self.norms: dict[int, float] = {}
        self.hashes: list[bytes] = []
        self.envelopes: list[torch.Tensor] = []
        self.block_norms: list[torch.Tensor] = []
        self.counts: list[int] = []

    async def run(self) -> None:
        stream: Stream | None = None
        try:
            try:
                # the reducer itself may wait round_timeout for a slow member before it averages a chunk
                stream = await self._until_given_up(asyncio.wait_for(
                    self._exchange(), self.config.round_timeout + self.config.join_timeout))
            finally:
                self.exchanged.set()
                await self.verification.row_done(self.index)  # sealed, or it never will be
            if await check_span(self.verification, self.index, self.member, self.chunks, *stream, self.report):
                self.audit_stream, stream = stream, None  # kept open for `audit`
        except Exception as e:  # noqa: BLE001 - a network boundary: hivemind raises ControlFailure, P2PHandlerError, ...
            await self.verification.no_statement(self.index)  # the other spans' reveals need not wait for it
            timed_out = isinstance(e, asyncio.TimeoutError)
            self.late = timed_out and stream is None  # kept us waiting for its averages, not for its checks
            reason = (str(e) or "timed out") if timed_out else f"{type(e).__name__}: {e}"
            logger.warning("Round %s: reducer %s of span %d failed: %s", self.group.round_id, self.member,
                           self.index, reason)
            self.report.excluded.setdefault(self.member, reason)
            self.report.failed_spans.append(self.index)
        finally:
            if stream is not None:
                stream[1].close()
        start = self.span[0]
        for k, (a, b) in enumerate(self.chunks):
            if k not in self.received:
                self.result[start + a : start + b] = self.flat[start + a : start + b]
        self.report.codec_error = max([self.report.codec_error, *self.errors])

    async def _until_given_up(self, exchange: Awaitable[Stream]) -> Stream:
        """``exchange``, or TimeoutError once ``give_up`` is set before it finished (its stream is closed)."""
        task, given_up = asyncio.ensure_future(exchange), asyncio.ensure_future(self.give_up.wait())
        try:
            await asyncio.wait((task, given_up), return_when=asyncio.FIRST_COMPLETED)
        finally:
            given_up.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))
        if task.cancelled():
            raise TimeoutError("seen absent lately, and behind the rest of the round")
        return task.result()

    def _code(self, k: int) -> Coded:
        a, b = self.chunks[k]
        # what coding drops goes to `dropped`, committed to the residual once the reducer includes the chunk
        payload, norm = encode_with_feedback(
            self.source[a:b], self.codec_config, self.guard.peer_id,
            carried=self.carried[a:b] if self.carried is not None else None,
            dropped=self.dropped[a:b] if self.dropped is not None else None, decoded=self.decoded[a:b],
            with_norm=True)
        bound = envelope(view(payload), self.decoded[a:b], self.codec_config.block_size)
        blocks = block_norms(self.decoded[a:b], self.codec_config.block_size)
        return payload, norm, blake3.blake3(payload).digest(), bound, blocks

    def _encode(self, k: int) -> asyncio.Future[Coded]:
        a, b = self.chunks[k]
        return asyncio.ensure_future(run_chunk_work(b - a, self._code, k))

    async def _exchange(self) -> Stream:
        first = self._encode(0)  # coded while the stream opens
        try:
            reader, writer = await self.guard.open(self.member, self.handler)
        except BaseException:
            first.cancel()
            raise
        sending = asyncio.ensure_future(self._send(writer, first))
        collecting = asyncio.ensure_future(self._collect_all(reader))
        try:
            # a failure on either side ends the exchange now, not when the reducer gives up on us
            await asyncio.wait((sending, collecting), return_when=asyncio.FIRST_EXCEPTION)
            for task in (sending, collecting):
                if task.done():
                    task.result()
            await collecting
            await sending
        except BaseException:
            writer.close()
            raise
        finally:
            sending.cancel()
            collecting.cancel()
        return reader, writer

    async def _send(self, writer: asyncio.StreamWriter, first: asyncio.Future[Coded]) -> None:
        v = self.verification
        request = pb.ReduceRequest(
            protocol_version=PROTOCOL_VERSION, round_id=self.group.round_id, span_index=self.index,
            span_numel=self.source.numel(), weight=self.weight, chunk_numel=self.config.chunk_numel,
            credentials=v.signing.credentials, seed_commitments=v.commitments_out,
        )
        sent = await write_message(writer, request)
        checks = pb.ReduceRequest(credentials=request.credentials, seed_commitments=request.seed_commitments).ByteSize()
        # after the await: the report is shared by the exchanges running at once
        self.report.bytes_sent += sent - checks
        self.report.check_bytes_sent += checks
        coding: asyncio.Future[Coded] | None = first
        for k in range(len(self.chunks)):
            assert coding is not None  # set for every chunk but after the last
            payload, self.norms[k], digest, bound, blocks = await coding
            self.hashes.append(digest)
            self.envelopes.append(bound)
            self.block_norms.append(blocks)
            self.counts.append(sent_count(payload))
            coding = self._encode(k + 1) if k + 1 < len(self.chunks) else None  # coded while this one drains
            # length and payload in one write: a lone 8-byte write would be a frame of its own on the wire
            sent = await write_frames(writer, [payload])
            self.report.bytes_sent += sent  # after the await: several reducers are fed at once
        seal = v.signing.sign(SEAL, *seal_parts(self.group.round_id, self.index, self.source.numel(),
                                                self.config.chunk_numel, self.weight, self.hashes))
        await v.row_sealed(self.index, OwnRow(self.decoded, self.chunks, self.envelopes, self.block_norms,
                                              self.counts), self.hashes)
        self.report.check_bytes_sent += await write_verify(writer, pb.VerifyMessage(seal=seal))

    async def _collect_all(self, reader: asyncio.StreamReader) -> None:
        for k in range(len(self.chunks)):
            await self._collect(reader, k)

    async def _collect(self, reader: asyncio.StreamReader, k: int) -> None:
        a, b = self.chunks[k]
        response = await read_message(reader, pb.ReduceResponse, self.member)
        signature = pb.ReduceResponse(signature=response.signature).ByteSize()
        self.report.bytes_received += frame_size(response.ByteSize()) - signature
        self.report.check_bytes_received += signature
        if response.code != pb.OK or response.chunk_index != k:
            raise ProtocolViolation(
                f"{self.member} refused our contribution: {pb.MessageCode.Name(response.code)} {response.message}",
                peer_id=self.member,
            )
        data = await read_frame(reader, max_payload_bytes(b - a), self.member, "averaged chunk")
        self.report.bytes_received += frame_size(len(data))
        await run_chunk_work(b - a, codec.decode, data, peer_id=self.member, expected_shape=(b - a,),
                             out=self.out[a:b])
        # the average's block norms for the checks, taken now that it sits in cache, not in the round's last step
        norms = await run_chunk_work(b - a, block_norms, self.out[a:b], self.verification.config.codec.block_size)
        self.verification.output_norms.setdefault(self.index, {})[k] = norms
        # hashed for this member's samples: two members holding different signed averages convict the reducer
        digest = await run_chunk_work(b - a, lambda: blake3.blake3(data).digest())
        self.verification.outputs.setdefault(self.index, {})[k] = (data, bytes(response.signature), digest)
        self.received.add(k)
        # included => the reducer got our chunk k, so its encoding (and `dropped`) is complete
        if self.carried is not None and self.dropped is not None and response.included:
            self.included[k] = scheme_of(data) is codec.Scheme.SPARSE8
            norm = self.norms.get(k, 0.0)
            self.errors.append(float(self.dropped[a:b].norm()) / norm if norm else 0.0)

    def commit_feedback(self, void: Collection[int]) -> None:
        """Once the average is applied: what coding dropped from included chunks but ``void`` joins the residual
        (a chunk keeping our own values keeps its residual, or what was dropped would be applied twice)."""
        carried, dropped = self.carried, self.dropped  # both set whenever a chunk was included
        for k, sparse in self.included.items():
            if k not in void and carried is not None and dropped is not None:
                a, b = self.chunks[k]
                carried[a:b] = dropped[a:b]
                if sparse:  # a SPARSE8 average carries no residual: ours takes what it left out of our row
                    readd_left_out(carried[a:b], self.decoded[a:b], self.out[a:b])

    async def audit(self) -> tuple[int, int]:
        """Challenges the span's reducer for the rows of the chunk its verdict drew, on the stream ``run`` left
        open, and judges them; returns the bytes (sent, received). Never raises for the reducer's faults."""
        assert self.audit_stream is not None
        reader, writer = self.audit_stream
        chunk = self.verification.verdicts[self.index].challenge
        assert chunk is not None
        try:
            return await challenge(self.verification, self.index, self.member, self.chunks, reader, writer, chunk)
        except (ConnectionError, OSError) as e:
            logger.warning("Round %s: could not audit span %d of %s: %s", self.group.round_id, self.index,
                           self.member, e)
            return 0, 0
        finally:
            writer.close()
