"""The reducer of one span in one round: validates contributions, averages them, answers each sender."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING

import torch

from peerd.averaging import codec
from peerd.averaging.wire import frame_size, read_frame, write_frame, write_message
from peerd.config import AveragingConfig, CodecConfig
from peerd.errors import CodecError
from peerd.proto import peerd_averaging_pb2 as pb

if TYPE_CHECKING:
    from peerd.averaging.allreduce import Group

logger = logging.getLogger(__name__)

MAX_WEIGHT = 1e12


def max_payload_bytes(numel: int) -> int:
    """Largest codec payload a span of ``numel`` elements may take (raw fp32 plus header and shape)."""
    return 4 * numel + 4096


class SpanReducer:
    def __init__(
        self,
        group: Group,
        rank: int,
        own: torch.Tensor,
        weight: float,
        config: AveragingConfig,
        codec_config: CodecConfig,
        peer_id: str,
        out: torch.Tensor,
    ) -> None:
        """``out`` receives the coded average of the span (the caller's slice of its result)."""
        self.codec_config = codec_config
        self.group = group
        self.rank = rank
        self.numel = own.numel()
        self.config = config
        self.peer_id = peer_id
        self.expected = set(group.members) - {peer_id}
        self.sum = torch.mul(own, weight)
        self.out = out
        self._scratch: torch.Tensor | None = None
        self.total_weight = weight
        self.contributors = 1
        self.used: set[str] = set()
        self.excluded: dict[str, str] = {}
        self.payload: bytearray | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._lock = asyncio.Lock()
        self._done = asyncio.Event()
        self._finalizing = False
        self._all_in = asyncio.Event()
        if not self.expected:
            self._all_in.set()
        self._answered: set[str] = set()
        self._all_answered = asyncio.Event()

    def _settle(self, sender: str, reason: str | None) -> None:
        if reason is None:
            self.used.add(sender)
        else:
            self.excluded.setdefault(sender, reason)
            logger.warning(
                "Round %s: excluded %s from span %d: %s", self.group.round_id, sender, self.rank, reason
            )
        if self.expected <= self.used | set(self.excluded):
            self._all_in.set()

    async def finish(self, timeout: float) -> None:
        """Waits for every member's contribution (or the timeout), then averages and codes the span once."""
        try:
            await asyncio.wait_for(self._all_in.wait(), timeout)
        except asyncio.TimeoutError:
            for member in self.expected - self.used - set(self.excluded):
                self._settle(member, f"no contribution within {timeout:.1f}s")
        async with self._lock:
            self._finalizing = True
            if self._answered >= self.used:
                self._all_answered.set()
            average = self.sum.div_(self.total_weight)
            self.payload = await asyncio.to_thread(codec.encode, average, self.codec_config)
            # Use the coded average ourselves too, so every member applies bit-identical values.
            await asyncio.to_thread(codec.decode, self.payload, peer_id=self.peer_id, out=self.out)
        self._done.set()

    async def serve(
        self,
        sender: str,
        request: pb.ReduceRequest,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.bytes_received += frame_size(request.ByteSize())
        problem = self._check(sender, request)
        if problem is not None:
            code, message = problem
            if code == pb.BAD_REQUEST:  # a member that sends nonsense is not waited for
                self._settle(sender, message)
            await self._respond(writer, pb.ReduceResponse(code=code, message=message))
            return
        data = await read_frame(reader, request.payload_bytes, sender, "contribution")
        self.bytes_received += frame_size(len(data))
        async with self._lock:
            if self._finalizing:
                await self._respond(
                    writer, pb.ReduceResponse(code=pb.TIMED_OUT, message="the span was already averaged")
                )
                return
            try:
                await asyncio.to_thread(self._accumulate, data, sender, request.weight)
            except CodecError as e:
                self._settle(sender, str(e))
                await self._respond(writer, pb.ReduceResponse(code=pb.BAD_PAYLOAD, message=str(e)))
                return
            self.total_weight += request.weight
            self.contributors += 1
            self._settle(sender, None)
        await self._done.wait()
        if self.payload is None:  # the round was abandoned (our side failed or shut down)
            await self._respond(
                writer, pb.ReduceResponse(code=pb.INTERNAL_ERROR, message="the reducer abandoned the round")
            )
            return
        response = pb.ReduceResponse(
            code=pb.OK,
            payload_bytes=len(self.payload),
            contributors=self.contributors,
            total_weight=self.total_weight,
        )
        try:
            await self._respond(writer, response, self.payload)
        finally:
            self._answered.add(sender)
            if self._answered >= self.used:
                self._all_answered.set()

    def _accumulate(self, data: bytes, sender: str, weight: float) -> None:
        """Decodes (validating everything) into a reused buffer, then adds; a bad payload adds nothing."""
        if self._scratch is None:
            self._scratch = torch.empty(self.numel, dtype=torch.float32)
        codec.decode(data, peer_id=sender, expected_shape=(self.numel,), max_numel=self.numel, out=self._scratch)
        self.sum.add_(self._scratch, alpha=weight)

    async def _respond(
        self, writer: asyncio.StreamWriter, response: pb.ReduceResponse, payload: bytearray | None = None
    ) -> None:
        # Count after each await: several senders are answered concurrently.
        sent = await write_message(writer, response)
        if payload is not None:
            sent += await write_frame(writer, payload)
        self.bytes_sent += sent

    def _check(self, sender: str, request: pb.ReduceRequest) -> tuple[int, str] | None:
        if sender not in self.group.members:
            return pb.NOT_A_MEMBER, f"{sender} is not in group {self.group.round_id}"
        if sender in self.used or sender in self.excluded:
            return pb.DUPLICATE, "already contributed or excluded"
        if self._finalizing or self._done.is_set():
            return pb.TIMED_OUT, "the span was already averaged"
        if request.protocol_version != 1:
            return pb.BAD_REQUEST, f"protocol version {request.protocol_version} (this peer speaks 1)"
        if request.span_index != self.rank or request.span_numel != self.numel:
            return pb.BAD_REQUEST, (
                f"span {request.span_index} of {request.span_numel} elements, expected span {self.rank} of "
                f"{self.numel} (different model or group view?)"
            )
        if not (math.isfinite(request.weight) and 0 < request.weight <= MAX_WEIGHT):
            return pb.BAD_REQUEST, f"weight {request.weight} is not finite and in (0, {MAX_WEIGHT:g}]"
        if request.payload_bytes > max_payload_bytes(self.numel):
            return pb.BAD_REQUEST, f"{request.payload_bytes}-byte payload for a {self.numel}-element span"
        return None

    async def answered(self, timeout: float) -> None:
        """Waits until every used contribution got its average back, so the byte counts are complete."""
        try:
            await asyncio.wait_for(self._all_answered.wait(), timeout)
        except asyncio.TimeoutError:
            logger.info("Round %s: not every sender collected span %d", self.group.round_id, self.rank)

    def close(self) -> None:
        """Releases every waiting sender; those still waiting get INTERNAL_ERROR."""
        self._done.set()
        self._all_in.set()
