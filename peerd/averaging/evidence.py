"""Proofs between members (protocol ``peerd.v1.averaging.evidence``): a member that caught a liar in a round
pushes the proof to the round's other members, and each checks it itself before excluding anyone
(verify/proofs.py). One stream per proof: a Proof frame, then its payload frames.

A peer can make us check proofs, so that is bounded: one proof at a time per sender and a few a minute, frames
no larger than one chunk's payload, and a proof's statement must check out before any payload is read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from google.protobuf.message import DecodeError

from peerd.averaging.verify.bans import BanList
from peerd.averaging.verify.keys import KeyBook
from peerd.averaging.verify.proofs import Evidence, check_proof, frame_limit, frames_expected, read_statement
from peerd.averaging.verify.streams import MAX_VERIFY_BYTES
from peerd.config import AveragingConfig
from peerd.errors import PeerdError, ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire.frames import read_frame, wait_for_close, write_frames
from peerd.wire.guard import StreamGuard

__all__ = ["EVIDENCE_HANDLER", "EvidenceDesk"]

logger = logging.getLogger(__name__)

EVIDENCE_HANDLER = "peerd.v1.averaging.evidence"
PROOFS_PER_MINUTE = 8
MAX_PUSHES = 64  # proofs being sent at once


class EvidenceDesk:
    def __init__(self, guard: StreamGuard, config: AveragingConfig, keys: KeyBook, bans: BanList) -> None:
        self.guard, self.config, self.keys, self.bans = guard, config, keys, bans
        self._checking: set[str] = set()
        self._recent: dict[str, deque[float]] = {}
        self._pushes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.guard.add_handler(EVIDENCE_HANDLER, self._handle)

    async def stop(self) -> None:
        await self.guard.remove_handler(EVIDENCE_HANDLER)
        for task in self._pushes:
            task.cancel()

    def push(self, peers: list[str], evidence: Evidence) -> None:
        """Sends ``evidence`` to each of ``peers`` in the background (best effort: each checks it itself)."""
        for peer in peers:
            if len(self._pushes) >= MAX_PUSHES:
                logger.info("Not sending a proof to %s: %d proofs on their way already", peer, MAX_PUSHES)
                continue
            task = asyncio.ensure_future(self._send(peer, evidence))
            self._pushes.add(task)
            task.add_done_callback(self._pushes.discard)

    async def _send(self, peer: str, evidence: Evidence) -> None:
        try:
            async with asyncio.timeout(self.config.verification.timeout * 3):
                reader, writer = await self.guard.open(peer, EVIDENCE_HANDLER)
                try:
                    await write_frames(writer, [evidence.proof.SerializeToString(), *evidence.frames])
                    await wait_for_close(reader, self.config.verification.timeout)
                finally:
                    writer.close()
        except (PeerdError, ConnectionError, OSError, TimeoutError) as e:
            logger.info("Could not send a proof against %s to %s: %r", evidence.proof.accused, peer, e)

    def _allowed(self, sender: str) -> bool:
        now = time.monotonic()
        recent = self._recent.setdefault(sender, deque())
        while recent and recent[0] < now - 60.0:
            recent.popleft()
        if sender in self._checking or len(recent) >= PROOFS_PER_MINUTE:
            return False
        if len(self._recent) > 4096:
            self._recent = {p: q for p, q in self._recent.items() if q}
        recent.append(now)
        return True

    async def _handle(self, info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = str(getattr(info, "peer_id", "?"))
        if not self._allowed(sender):
            return
        self._checking.add(sender)
        try:
            async with asyncio.timeout(self.config.verification.timeout * 3):
                accused, reason = await self._read_and_check(sender, reader)
            if reason is not None:
                self.bans.ban(accused, f"{reason} (proof from {sender})", proven=True)
            else:
                logger.info("A proof from %s against %s shows nothing", sender, accused)
        except (ProtocolViolation, DecodeError, ConnectionError, OSError, TimeoutError) as e:
            logger.info("Dropped a proof from %s: %r", sender, e)
        finally:
            self._checking.discard(sender)
            writer.close()

    async def _read_and_check(self, sender: str, reader: asyncio.StreamReader) -> tuple[str, str | None]:
        proof = pb.ReductionProof.FromString(await read_frame(reader, MAX_VERIFY_BYTES, sender, "proof"))
        statement, group = read_statement(proof.statement, self.keys)
        if proof.chunk_index >= len(statement.chunks):
            raise ProtocolViolation(f"{sender}'s proof names chunk {proof.chunk_index} of {len(statement.chunks)}",
                                    peer_id=sender)
        limit = frame_limit(statement, proof.chunk_index)
        frames = [await read_frame(reader, limit, sender, "proof payload")
                  for _ in range(frames_expected(proof, statement))]
        reason = await asyncio.to_thread(check_proof, proof, statement, group, frames, self.config, self.keys)
        return proof.accused, reason
