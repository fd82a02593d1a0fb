"""The reducer of one span in one round: validates contributions chunk by chunk and averages each chunk as
soon as every member still in the round has delivered it, so averages flow back while contributions still
arrive. A member whose chunk fails validation, whose stream breaks or who is too slow is excluded from the
rest of the round; its earlier, valid chunks stay in their averages. Nothing invalid is ever added.

With ``averaging.aggregation: mean`` each chunk's running sum lives in the caller's result slice and starts
when the chunk is first touched, so a round does no span-sized work before its first chunk leaves (the
uplink would sit idle meanwhile). A robust rule keeps every member's decoded chunk instead and combines
them once all are in (robust.py): the rule needs them together, and combining in rank order makes the result
independent of arrival order."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading

import torch

from peerd.averaging.compute import run_chunk_work
from peerd.averaging.group import Clipping, Group
from peerd.averaging.layout import chunk_bounds, max_payload_bytes
from peerd.averaging.requests import SpanView, check_request
from peerd.averaging.robust import WINDOW, RobustChunks, rule_label
from peerd.config import AveragingConfig, CodecConfig
from peerd.errors import CodecError, ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire import codec
from peerd.wire.feedback import encode_with_feedback
from peerd.wire.frames import LINGER_BYTES, frame_size, read_frame, wait_for_close, write_frames

logger = logging.getLogger(__name__)


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
        residual: torch.Tensor | None = None,
        own_residual: torch.Tensor | None = None,
        agreeing: bool = False,
    ) -> None:
        """``out`` receives the coded average of the span (the caller's slice of its result); ``residual``, if
        given, carries what coding the average dropped into this peer's next average of the same elements;
        ``own_residual``, if given, is added to ``own`` and zeroed chunk by chunk (it enters the average
        exactly). ``agreeing``: the members' rows are meant to be identical (aggregation.combine)."""
        self.residual, self.own_residual = residual, own_residual
        self.group, self.rank, self.config, self.codec_config = group, rank, config, codec_config
        self.peer_id, self.out, self.own, self.own_weight = peer_id, out, own, weight
        self.numel = own.numel()
        self.chunks = chunk_bounds(self.numel, config.chunk_numel)
        self.view = SpanView(group, peer_id, rank, self.numel, config.chunk_numel)
        senders = set(group.members) - {peer_id}
        self.expected = senders
        self.pending = [set(senders) for _ in self.chunks]  # whose chunk k we still wait for
        self.weights = [weight for _ in self.chunks]
        self.included: list[set[str]] = [{peer_id} for _ in self.chunks]
        self.payloads: list[bytearray | None] = [None for _ in self.chunks]
        self.ready = [asyncio.Event() for _ in self.chunks]
        self.excluded: dict[str, str] = {}
        self.serving: set[str] = set()
        self.bytes_sent = 0
        self.bytes_received = 0
        self._started = [False for _ in self.chunks]
        self._sum_lock = threading.Lock()  # large chunks are added from worker threads
        self._finalizing: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._answered: set[str] = set()
        self._all_answered = asyncio.Event()
        self._closed = False
        self.rule = rule_label(config, len(group.members))
        self.robust: RobustChunks | None = None
        if config.aggregation != "mean":
            self.robust = RobustChunks(group, rank, min(self.numel, config.chunk_numel), config, agreeing)
            self.robust.claims[peer_id] = weight
        for index in range(len(self.chunks)):
            self._maybe_finalize(index)

    # --- bookkeeping ------------------------------------------------------------------------------------------

    def _maybe_finalize(self, index: int) -> None:
        if not self.pending[index] and index not in self._finalizing and not self._closed:
            self._finalizing.add(index)
            task = asyncio.ensure_future(self._finalize(index))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _finalize(self, index: int) -> None:
        start, end = self.chunks[index]
        try:
            self.payloads[index] = await run_chunk_work(end - start, self._average_chunk, index)
        except ValueError as e:  # our own values are not finite: nobody can use this chunk's average
            logger.error("Round %s: cannot average chunk %d of span %d: %s", self.group.round_id, index,
                         self.rank, e)
            self.out[start:end] = self.own[start:end]  # as for any failed span: this peer's own values
        finally:
            self.ready[index].set()  # a chunk without payload is answered INTERNAL_ERROR

    def _start(self, index: int) -> None:
        """Seeds chunk ``index``'s sum with this peer's weighted values, once; under ``_sum_lock``."""
        if self._started[index]:
            return
        start, end = self.chunks[index]
        acc = self.out[start:end]
        if self.own_residual is not None:
            torch.add(self.own[start:end], self.own_residual[start:end], out=acc).mul_(self.own_weight)
            self.own_residual[start:end] = 0
        else:
            torch.mul(self.own[start:end], self.own_weight, out=acc)
        self._started[index] = True

    def _average_chunk(self, index: int) -> bytearray:
        start, end = self.chunks[index]
        with self._sum_lock:  # after this, _add refuses the chunk (it is in _finalizing)
            if self.robust is None:
                self._start(index)
                average = self.out[start:end].div_(self.weights[index])
            else:
                own = self.robust.row(index, self.peer_id, end - start).copy_(self.own[start:end])
                if self.own_residual is not None:
                    own.add_(self.own_residual[start:end])
                    self.own_residual[start:end] = 0
                included = set(self.included[index])
        if self.robust is not None:
            average = self.out[start:end]
            self.weights[index] = self.robust.combine(index, included, end - start, average)
        # Code the average plus what coding dropped from our last one, and use the decoded average ourselves
        # too, so every member applies bit-identical values.
        residual = self.residual[start:end] if self.residual is not None else None
        payload, _ = encode_with_feedback(
            average, self.codec_config, self.peer_id, carried=residual, dropped=residual, decoded=average)
        return payload

    def exclude(self, sender: str, reason: str) -> None:
        if sender in self.excluded or self._closed:
            return
        self.excluded[sender] = reason
        logger.warning("Round %s: excluded %s from span %d: %s", self.group.round_id, sender, self.rank, reason)
        for index, waiting in enumerate(self.pending):
            waiting.discard(sender)
            self._maybe_finalize(index)

    async def finish(self, timeout: float) -> None:
        """Waits until every chunk is averaged; after ``timeout`` the members still missing are excluded."""
        try:
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in self.ready)), timeout)
        except TimeoutError:
            for sender in sorted(set().union(*self.pending)):
                self.exclude(sender, f"contribution incomplete after {timeout:.1f}s")
            await asyncio.gather(*(event.wait() for event in self.ready))
        if self.robust is not None:
            self.robust.log(len(self.chunks))

    @property
    def clipped(self) -> dict[str, Clipping]:
        """Members whose contributions to this span a robust rule clipped or weight-capped."""
        return dict(self.robust.clipped) if self.robust is not None else {}

    async def answered(self, timeout: float) -> None:
        """Waits until every member still in the round has been sent all averages, so byte counts are final."""
        if self._answered | set(self.excluded) >= self.expected:
            return
        try:
            await asyncio.wait_for(self._all_answered.wait(), timeout)
        except TimeoutError:
            logger.info("Round %s: not every member collected span %d", self.group.round_id, self.rank)

    def close(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for event in self.ready:
            event.set()

    # --- one sender's stream ----------------------------------------------------------------------------------

    async def serve(
        self, sender: str, request: pb.ReduceRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.bytes_received += frame_size(request.ByteSize())
        problem = check_request(self.view, sender, request, set(self.excluded) | self.serving)
        if problem is not None:
            code, message = problem
            if code == pb.BAD_REQUEST:  # a member that sends nonsense is not waited for
                self.exclude(sender, message)
            await self._send(writer, pb.ReduceResponse(code=code, message=message))
            await wait_for_close(reader)  # its chunks may follow the request: closing now could drop the refusal
            return
        self.serving.add(sender)
        if self.robust is not None:
            self.robust.claims[sender] = request.weight
        answers = asyncio.ensure_future(self._answer(sender, writer))
        try:
            await self._receive(sender, request.weight, reader)
        except (ProtocolViolation, CodecError, ConnectionError, OSError) as e:
            self.exclude(sender, str(e))
        await answers
        # Let the sender close the stream: closing it from here could cut averages still in flight in p2pd's
        # buffers on a slow link (over QUIC, closing with input unread drops them every time). A sender that
        # sends more after its last chunk is not waited for; one excluded mid-stream (an oversized or
        # undecodable chunk) may still have the rest of its chunks on the way, which are read and dropped.
        rest = LINGER_BYTES if sender in self.excluded else 1
        await wait_for_close(reader, self.config.join_timeout, max_discard=rest)

    async def _receive(self, sender: str, weight: float, reader: asyncio.StreamReader) -> None:
        scratch = torch.empty(min(self.numel, self.config.chunk_numel), dtype=torch.float32)
        adding: asyncio.Future[None] | None = None
        for index, (start, end) in enumerate(self.chunks):
            if self.robust is not None and index >= WINDOW:
                await self.ready[index - WINDOW].wait()  # bounds the decoded chunks held (robust.py)
            data = await read_frame(reader, max_payload_bytes(end - start), sender, f"chunk {index}")
            self.bytes_received += frame_size(len(data))
            if adding is not None:
                await adding  # a large chunk decodes in a thread while the next one arrives
            if sender in self.excluded:
                return
            adding = asyncio.ensure_future(
                run_chunk_work(end - start, self._add, data, sender, weight, index, scratch))
            adding.add_done_callback(functools.partial(self._added, sender=sender, index=index))
        if adding is not None:
            await adding

    def _add(self, data: bytes, sender: str, weight: float, index: int, scratch: torch.Tensor) -> None:
        start, end = self.chunks[index]
        if self.robust is not None:
            with self._sum_lock:
                self._check_open(index, sender)
                row = self.robust.row(index, sender, end - start)
            # only this sender writes its row, and the chunk is not combined before it counts as included
            codec.decode(data, peer_id=sender, expected_shape=(end - start,), max_numel=end - start, out=row)
            with self._sum_lock:
                self._check_open(index, sender)  # excluded meanwhile (e.g. timed out): its row is not read
                self.included[index].add(sender)
            return
        chunk = scratch[: end - start]
        codec.decode(data, peer_id=sender, expected_shape=(end - start,), max_numel=end - start, out=chunk)
        with self._sum_lock:  # sum, weight and membership change together, or not at all
            self._check_open(index, sender)
            self._start(index)
            self.out[start:end].add_(chunk, alpha=weight)
            self.weights[index] += weight
            self.included[index].add(sender)

    def _check_open(self, index: int, sender: str) -> None:
        """Under ``_sum_lock``: ProtocolViolation if chunk ``index`` is already being averaged."""
        if index in self._finalizing:
            raise ProtocolViolation(f"{sender}'s chunk {index} arrived after it was averaged", peer_id=sender)

    def _added(self, done: asyncio.Future[None], sender: str, index: int) -> None:
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            self.exclude(sender, str(error))
            return
        self.pending[index].discard(sender)
        self._maybe_finalize(index)

    async def _answer(self, sender: str, writer: asyncio.StreamWriter) -> None:
        try:
            for index in range(len(self.chunks)):
                await self.ready[index].wait()
                payload = self.payloads[index]
                if payload is None:  # the round was abandoned, or our own values could not be averaged
                    await self._send(writer, pb.ReduceResponse(code=pb.INTERNAL_ERROR, message="no average"))
                    return
                response = pb.ReduceResponse(
                    code=pb.OK, chunk_index=index, contributors=len(self.included[index]),
                    total_weight=self.weights[index], included=sender in self.included[index],
                )
                await self._send(writer, response, payload)
        except (ConnectionError, OSError) as e:
            logger.info("Round %s: could not return span %d to %s: %s", self.group.round_id, self.rank, sender, e)
        finally:
            self._answered.add(sender)
            if self._answered | set(self.excluded) >= self.expected:
                self._all_answered.set()

    async def _send(
        self, writer: asyncio.StreamWriter, response: pb.ReduceResponse, payload: bytes | bytearray | None = None
    ) -> None:
        # One write for the response and its payload: one wake-up of p2pd, no lone tiny frame on the wire.
        frames = [response.SerializeToString()] + ([payload] if payload is not None else [])
        # not `self.bytes_sent += await ...`: that reads the counter before the await, and the answers to
        # the other senders, running meanwhile, would have their counts overwritten
        sent = await write_frames(writer, frames)
        self.bytes_sent += sent
