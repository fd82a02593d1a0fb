"""What a reducer keeps of its span to sign its statement and to answer challenges, and its side of each
sender's stream once the data has moved (seed share and samples in, one challenge answered).

Every contribution chunk is hashed as it arrives; a sender's seal must cover exactly those hashes. A chunk
whose average includes a row its sender did not seal (its stream broke off, or its seal does not check out) is
marked void, and nobody applies it: the reducer could not show that row if challenged.
"""

from __future__ import annotations

import asyncio
import logging

import blake3
import torch

from peerd.averaging.aggregation import Combined
from peerd.averaging.layout import chunk_bounds
from peerd.averaging.verify.round import RoundVerification
from peerd.averaging.verify.samples import OwnRow
from peerd.averaging.verify.statement import OUTPUT, SEAL, output_parts, seal_parts, sign_statement
from peerd.averaging.verify.streams import read_verify_or_eof, write_verify
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire.frames import write_frames

__all__ = ["SpanRecord"]

logger = logging.getLogger(__name__)


class SpanRecord:
    def __init__(self, verification: RoundVerification, numel: int, rule: str, own_weight: float,
                 own_row: torch.Tensor) -> None:
        """``own_row``: where this reducer's own row of the span is decoded to (for its samples)."""
        self.v = verification
        self.own_row = own_row
        self.group, self.rank = verification.group, verification.rank
        self.numel, self.rule = numel, rule
        self.chunks = chunk_bounds(numel, verification.config.chunk_numel)
        count = len(self.chunks)
        self.payloads: dict[int, list[bytes | bytearray | None]] = {self.rank: [None] * count}
        self.hashes: dict[int, list[bytes | None]] = {self.rank: [None] * count}
        self.weights: dict[int, float] = {self.rank: own_weight}
        self.credentials: dict[int, pb.Credentials] = {self.rank: verification.signing.credentials}
        self.seals: dict[int, bytes] = {}
        self.sealed: dict[int, asyncio.Event] = {}
        self.records: list[pb.ChunkRecord] = [pb.ChunkRecord() for _ in self.chunks]
        self.signatures: list[bytes] = [b""] * count
        self.own_envelopes: list[torch.Tensor] = [torch.zeros(0)] * count
        self.own_norms: list[torch.Tensor] = [torch.zeros(0)] * count
        self._statement: asyncio.Future[pb.Signed] | None = None

    def request(self, sender: str, request: pb.ReduceRequest) -> None:
        """Takes note of a sender's request; ProtocolViolation if its credentials are not its own."""
        self.v.keys.key_of(request.credentials, sender)
        rank = self.group.rank_of(sender)
        self.payloads[rank] = [None] * len(self.chunks)
        self.hashes[rank] = [None] * len(self.chunks)
        self.weights[rank] = request.weight
        self.credentials[rank] = request.credentials
        self.sealed[rank] = asyncio.Event()
        self.v.note_request(sender, request)

    def received(self, sender: str, index: int, payload: bytes) -> None:
        rank = self.group.rank_of(sender)
        self.payloads[rank][index] = payload
        self.hashes[rank][index] = blake3.blake3(payload).digest()

    def seal(self, sender: str, seal: bytes) -> None:
        """Checks and keeps ``sender``'s seal over what it sent; ProtocolViolation if it does not cover it."""
        rank = self.group.rank_of(sender)
        try:
            hashes = self.hashes[rank]
            if any(h is None for h in hashes) or not self.v.keys.valid(
                    self.credentials[rank], sender, seal, SEAL, *seal_parts(
                        self.group.round_id, self.rank, self.numel, self.v.config.chunk_numel, self.weights[rank],
                        [h for h in hashes if h is not None])):
                raise ProtocolViolation(f"{sender}'s seal does not cover what it sent", peer_id=sender)
            self.seals[rank] = seal
        finally:
            self.sealed[rank].set()

    def unsealed(self, sender: str) -> None:
        event = self.sealed.get(self.group.rank_of(sender))
        if event is not None:
            event.set()

    def own(self, index: int, payload: bytes | bytearray, bound: torch.Tensor, norms: torch.Tensor) -> None:
        """This reducer's own row of chunk ``index``, as coded (its statement's signature binds it), its envelope
        and block norms."""
        self.payloads[self.rank][index] = payload
        self.hashes[self.rank][index] = blake3.blake3(payload).digest()
        self.own_envelopes[index] = bound
        self.own_norms[index] = norms

    def combined(self, index: int, members: list[str], coefficients: list[float] | None,
                 how: Combined | None = None) -> None:
        """How chunk ``index``'s average was made: ``members`` in rank order, their ``coefficients``, and what a
        robust rule did (``how``: copies, medoid, Gram matrix, norms)."""
        record = self.records[index]
        record.included[:] = [self.group.rank_of(m) for m in members]
        if coefficients is not None:
            record.coefficients[:] = coefficients
        if how is None:
            return
        record.medoid = how.medoid
        if how.gram is not None:
            record.gram[:] = how.gram.reshape(-1).tolist()
        if how.norms is not None:
            record.norms[:] = how.norms.tolist()
        if how.same_as is not None:
            record.same_as[:] = how.same_as

    def sign_output(self, index: int, payload: bytes | bytearray) -> bytes:
        digest = blake3.blake3(payload).digest()
        self.signatures[index] = self.v.signing.sign(OUTPUT, *output_parts(self.group.round_id, self.rank, index,
                                                                            digest))
        return self.signatures[index]

    async def statement(self, averaged: list[asyncio.Event]) -> pb.Signed:
        """The signed statement, once every chunk is averaged and every included sender sealed (or did not)."""
        if self._statement is None:
            self._statement = asyncio.ensure_future(self._build(averaged))
        return await asyncio.shield(self._statement)

    async def _build(self, averaged: list[asyncio.Event]) -> pb.Signed:
        await asyncio.gather(*(event.wait() for event in averaged))
        self.v.own_rows[self.rank] = OwnRow(self.own_row, self.chunks, self.own_envelopes, self.own_norms)
        self.v.settled.set()
        included = {r for record in self.records for r in record.included} - {self.rank}
        waiting = [self.sealed[r].wait() for r in included if r in self.sealed]
        try:
            await asyncio.wait_for(asyncio.gather(*waiting), self.v.config.verification.timeout)
        except TimeoutError:
            pass
        statement = pb.SpanStatement(
            round_id=self.group.round_id, span_index=self.rank, span_numel=self.numel,
            chunk_numel=self.v.config.chunk_numel, members=list(self.group.members), rule=self.rule,
            reducer=self.v.signing.credentials)
        for rank in sorted(included | {self.rank}):
            hashes = self.hashes[rank]
            count = next((i for i, h in enumerate(hashes) if h is None), len(hashes))
            statement.rows.add(rank=rank, weight=self.weights[rank], chunk_hashes=[h for h in hashes[:count] if h],
                               seal=self.seals.get(rank, b""), credentials=self.credentials[rank])
        for index, record in enumerate(self.records):
            record.void = any(r != self.rank and r not in self.seals for r in record.included)
            statement.chunks.append(record)
            if record.void:
                self.v.own_void.append(index)
        signed = sign_statement(self.v.signing, statement)
        await self.v.no_statement(self.rank)  # signed: this member's share of its own span may go out
        return signed

    async def serve(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A sender's verification messages after its seal: its seed share and its samples of each span, then at
        most one challenge."""
        wait = 3 * self.v.config.verification.timeout  # a challenge follows the sender's own checks
        spans, shares, samples = len(self.group.members), set(), 0
        while True:
            message = await read_verify_or_eof(reader, sender, wait)
            kind = None if message is None else message.WhichOneof("body")
            if message is None:
                return
            if kind == "share" and message.share.span_index < spans and message.share.span_index not in shares:
                shares.add(message.share.span_index)
                await self.v.reveal_from(sender, message.share.span_index, bytes(message.share.share))
            elif kind == "samples" and samples < spans:
                samples += 1
                await self.v.samples_from(sender, message.samples)
                # the sender waits for this before it closes: closing right after its samples could drop them
                await write_verify(writer, pb.VerifyMessage(received=True))
            elif kind == "challenge":
                await self._answer(sender, message.challenge, writer)
                return
            else:
                raise ProtocolViolation(f"{sender} sent an unexpected {kind} message (or one too many)",
                                        peer_id=sender)

    async def _answer(self, sender: str, index: int, writer: asyncio.StreamWriter) -> None:
        rows = None
        if index < len(self.records):
            rows = [self.payloads[r][index] for r in self.records[index].included]
        if rows is None or any(row is None for row in rows):
            await write_verify(writer, pb.VerifyMessage(answer=pb.Answer(chunk_index=index, ok=False,
                                                                          message="no such chunk")))
            return
        logger.info("Round %s: %s challenged chunk %d of span %d; revealing its %d rows", self.group.round_id,
                    sender, index, self.rank, len(rows))
        await write_verify(writer, pb.VerifyMessage(answer=pb.Answer(chunk_index=index, ok=True)))
        await write_frames(writer, [row for row in rows if row is not None])
