"""Weighted all-reduce of one flat tensor within a group, 8-bit coded, over libp2p streams.

Reduce-scatter then all-gather, as hivemind's butterfly all-reduce: the flat tensor is cut into one span
per member (aligned to codec blocks); member ``r`` reduces span ``r``. Every other member opens one stream
to it, sends its coded contribution and receives the coded average back on the same stream. The reducer
also decodes its own coded average, so every member ends with bit-identical values.

A contribution that fails validation (wrong round, span, size, weight, NaN/Inf, bad codec payload) is
refused with a reason, logged with the sender's peer id and left out of the average; a member that does
not answer within the round's timeout is left out too. Spans whose reducer failed keep this peer's own
values, so the result is always finite and the caller learns which peers were excluded.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2P, PeerID

from peerd.averaging import codec
from peerd.averaging.reducer import SpanReducer, chunk_bounds, max_payload_bytes
from peerd.averaging.wire import frame_size, read_frame, read_message, write_frame, write_message
from peerd.config import AveragingConfig, CodecConfig
from peerd.errors import GroupFailed, ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb

logger = logging.getLogger(__name__)

HANDLER_NAME = "peerd.v1.averaging.reduce"
PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class Group:
    """The members of one all-reduce round, in rank order; identical on every member."""

    round_id: str
    members: tuple[str, ...]

    def rank_of(self, peer_id: str) -> int:
        return self.members.index(peer_id)


@dataclass
class RoundReport:
    """What happened in one round, for logs, status and metrics."""

    round_id: str
    group_size: int
    duration: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    codec_error: float = 0.0  # relative L2 error of this peer's coded contributions
    excluded: dict[str, str] = field(default_factory=dict)  # peer id -> reason
    failed_spans: list[int] = field(default_factory=list)


def split_spans(numel: int, parts: int, align: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) spans, as equal as ``align``-sized blocks allow (last ones may be empty)."""
    blocks = math.ceil(numel / align) if numel else 0
    bounds = [min(numel, (blocks * i // parts) * align) for i in range(parts + 1)]
    bounds[-1] = numel
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def _encode_chunk(
    chunk: torch.Tensor, config: CodecConfig, dropped: torch.Tensor | None, peer_id: str
) -> bytearray:
    """Codes one chunk; with error feedback also computes what the coding dropped (into ``dropped``)."""
    payload = codec.encode(chunk, config)
    if dropped is not None:
        codec.decode(payload, peer_id=peer_id, out=dropped)
        torch.sub(chunk, dropped, out=dropped)
    return payload


class AllReducer:
    """Serves span reductions to other members and runs this peer's side of each round."""

    def __init__(self, p2p: P2P, config: AveragingConfig) -> None:
        self.p2p = p2p
        self.config = config
        self.peer_id = str(p2p.peer_id)
        self._reducers: dict[str, SpanReducer] = {}
        self._round_registered = asyncio.Condition()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(HANDLER_NAME, self._handle_stream)

    async def stop(self) -> None:
        await self.p2p.remove_binary_stream_handler(HANDLER_NAME)

    # --- this peer's side of a round --------------------------------------------------------------------------

    async def all_reduce(
        self,
        group: Group,
        flat: torch.Tensor,
        weight: float,
        residual: torch.Tensor | None = None,
        codec_config: CodecConfig | None = None,
        average_residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RoundReport]:
        """Returns the weighted group average of ``flat`` and a report; never raises for peers' faults.

        ``residual`` (same shape as ``flat``) enables error feedback: what quantization dropped from this
        peer's contributions is added to its next ones. ``codec_config`` overrides ``averaging.codec`` for
        this round (e.g. lossless for parameters). ``average_residual`` (same shape) does the same for the
        averages this peer codes as a reducer, the second quantization every element goes through.
        Raises GroupFailed only if this peer is not a member.
        """
        codec_config = codec_config or self.config.codec
        if self.peer_id not in group.members:
            raise GroupFailed(f"{self.peer_id} is not a member of round {group.round_id}")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be finite and positive, got {weight}")
        if flat.dim() != 1 or flat.dtype != torch.float32:
            raise ValueError("all_reduce takes a flat float32 tensor")  # the codec refuses NaN/Inf as it encodes
        started = time.monotonic()
        report = RoundReport(group.round_id, len(group.members))
        rank = group.rank_of(self.peer_id)
        spans = split_spans(flat.numel(), len(group.members), codec_config.block_size)
        result = torch.empty_like(flat)
        start, end = spans[rank]
        own = flat[start:end]
        if residual is not None:  # our own span enters the average exactly, so its carried error is used up
            own = own + residual[start:end]
            residual[start:end] = 0
        reducer = SpanReducer(
            group, rank, own, weight, self.config, codec_config, self.peer_id, result[start:end],
            average_residual[start:end] if average_residual is not None else None,
        )
        async with self._round_registered:
            self._reducers[group.round_id] = reducer
            self._round_registered.notify_all()
        try:
            sends = [
                self._contribute(group, member, spans[i], flat, weight, residual, result, report, codec_config)
                for i, member in enumerate(group.members)
                if i != rank
            ]
            deadline = self.config.round_timeout
            own = asyncio.ensure_future(reducer.finish(deadline))
            await asyncio.wait_for(asyncio.gather(own, *sends), deadline + self.config.join_timeout + 5.0)
            await reducer.answered(self.config.join_timeout)
            report.excluded.update(reducer.excluded)
            report.bytes_sent += reducer.bytes_sent
            report.bytes_received += reducer.bytes_received
        finally:
            self._reducers.pop(group.round_id, None)
            reducer.close()
        report.duration = time.monotonic() - started
        return result, report

    async def _contribute(
        self,
        group: Group,
        member: str,
        span: tuple[int, int],
        flat: torch.Tensor,
        weight: float,
        residual: torch.Tensor | None,
        result: torch.Tensor,
        report: RoundReport,
        codec_config: CodecConfig,
    ) -> None:
        """Streams our chunks of ``member``'s span to it and decodes the averaged chunks it streams back.

        Chunks whose average never arrives keep our own values; error feedback is carried only for the
        chunks the reducer says it included.
        """
        start, end = span
        index = group.rank_of(member)
        source = flat[start:end]
        if residual is not None:
            source = source + residual[start:end]
        chunks = chunk_bounds(end - start, self.config.chunk_numel)
        received: set[int] = set()
        errors: list[float] = []
        try:
            await asyncio.wait_for(
                self._exchange(group, member, index, weight, source, chunks, result[start:end],
                               residual[start:end] if residual is not None else None, received, errors,
                               report, codec_config),
                # the reducer itself may wait round_timeout for a slow member before it averages a chunk
                self.config.round_timeout + self.config.join_timeout,
            )
        except Exception as e:  # a network boundary: hivemind raises ControlFailure, P2PHandlerError, ... too
            reason = "timed out" if isinstance(e, asyncio.TimeoutError) else f"{type(e).__name__}: {e}"
            logger.warning("Round %s: reducer %s of span %d failed: %s", group.round_id, member, index, reason)
            report.excluded.setdefault(member, reason)
            report.failed_spans.append(index)
        for k, (a, b) in enumerate(chunks):
            if k not in received:
                result[start + a : start + b] = flat[start + a : start + b]
        if errors:
            report.codec_error = max(report.codec_error, max(errors))

    async def _exchange(
        self,
        group: Group,
        member: str,
        index: int,
        weight: float,
        source: torch.Tensor,
        chunks: list[tuple[int, int]],
        out: torch.Tensor,
        residual: torch.Tensor | None,
        received: set[int],
        errors: list[float],
        report: RoundReport,
        codec_config: CodecConfig,
    ) -> None:
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(member), HANDLER_NAME)
        # What quantization drops from each chunk, committed to the residual once the chunk is included.
        dropped = torch.empty_like(source) if residual is not None else None
        try:
            request = pb.ReduceRequest(
                protocol_version=PROTOCOL_VERSION, round_id=group.round_id, span_index=index,
                span_numel=source.numel(), weight=weight, chunk_numel=self.config.chunk_numel,
            )
            sent = await write_message(writer, request)
            report.bytes_sent += sent

            async def send_chunks() -> None:
                for a, b in chunks:
                    payload = await asyncio.to_thread(_encode_chunk, source[a:b], codec_config,
                                                      dropped[a:b] if dropped is not None else None, self.peer_id)
                    sent = await write_frame(writer, payload)
                    report.bytes_sent += sent  # after the await: several reducers are fed concurrently

            sending = asyncio.ensure_future(send_chunks())
            try:
                for k, (a, b) in enumerate(chunks):
                    response = await read_message(reader, pb.ReduceResponse, member)
                    report.bytes_received += frame_size(response.ByteSize())
                    if response.code != pb.OK or response.chunk_index != k:
                        raise ProtocolViolation(
                            f"{member} refused our contribution: {pb.MessageCode.Name(response.code)} "
                            f"{response.message}", peer_id=member,
                        )
                    data = await read_frame(reader, max_payload_bytes(b - a), member, "averaged chunk")
                    report.bytes_received += frame_size(len(data))
                    await asyncio.to_thread(codec.decode, data, peer_id=member, expected_shape=(b - a,), out=out[a:b])
                    received.add(k)
                    # included => the reducer got our chunk k, so its encoding (and `dropped`) is complete
                    if residual is not None and dropped is not None and response.included:
                        residual[a:b] = dropped[a:b]
                        norm = float(source[a:b].norm())
                        errors.append(float(dropped[a:b].norm()) / norm if norm else 0.0)
                await sending
            finally:
                sending.cancel()
        finally:
            writer.close()

    # --- serving other members ------------------------------------------------------------------------------

    async def _handle_stream(
        self, info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sender = str(getattr(info, "peer_id", "?"))
        try:
            request = await read_message(reader, pb.ReduceRequest, sender)
            reducer = await self._wait_for_round(request.round_id)
            if reducer is None:
                await write_message(
                    writer, pb.ReduceResponse(code=pb.UNKNOWN_ROUND, message="not in this round")
                )
                return
            await reducer.serve(sender, request, reader, writer)
        except ProtocolViolation as e:
            logger.warning("Dropping averaging stream from %s: %s", sender, e)
        except (ConnectionError, asyncio.IncompleteReadError, OSError) as e:
            logger.info("Averaging stream from %s broke: %s", sender, e)
        finally:
            writer.close()

    async def _wait_for_round(self, round_id: str) -> SpanReducer | None:
        """A sender may finish matchmaking a moment before we do; give our side time to register."""
        async with self._round_registered:
            try:
                await asyncio.wait_for(
                    self._round_registered.wait_for(lambda: round_id in self._reducers),
                    self.config.join_timeout,
                )
            except asyncio.TimeoutError:
                return None
            return self._reducers[round_id]
