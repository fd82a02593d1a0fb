"""Weighted all-reduce of one flat tensor within a group, 8-bit coded, over libp2p streams.

Reduce-scatter then all-gather, as hivemind's butterfly all-reduce: the flat tensor is cut into one span
per member (aligned to codec blocks, layout.py); member ``r`` reduces span ``r``. Every other member opens
one stream to it, sends its coded contribution chunk by chunk and receives the coded average back on the same
stream (sender.py); the reducer (reducer.py) averages each chunk as soon as every member delivered it, so both
halves of the all-reduce run at once. The reducer also decodes its own coded
average, so every member ends with bit-identical values. Wire format: protocols/peerd_averaging.proto.

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

import torch

from peerd.averaging.group import Group, RoundReport
from peerd.averaging.layout import split_spans
from peerd.averaging.reducer import SpanReducer
from peerd.averaging.requests import PROTOCOL_VERSION
from peerd.averaging.sender import SpanExchange
from peerd.config import AveragingConfig, CodecConfig
from peerd.errors import GroupFailed, ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire.frames import read_message, wait_for_close, write_message
from peerd.wire.guard import StreamGuard

__all__ = ["HANDLER_NAME", "PROTOCOL_VERSION", "AllReducer"]

logger = logging.getLogger(__name__)

HANDLER_NAME = "peerd.v1.averaging.reduce"


class AllReducer:
    """Serves span reductions to other members and runs this peer's side of each round."""

    def __init__(self, guard: StreamGuard, config: AveragingConfig) -> None:
        """``guard``: every stream, served or opened, passes its membership handshake and limits first."""
        self.guard = guard
        self.config = config
        self.peer_id = guard.peer_id
        self._reducers: dict[str, SpanReducer] = {}
        self._round_registered = asyncio.Condition()

    async def start(self) -> None:
        await self.guard.add_handler(HANDLER_NAME, self._handle_stream)

    async def stop(self) -> None:
        await self.guard.remove_handler(HANDLER_NAME)

    # --- this peer's side of a round --------------------------------------------------------------------------

    async def all_reduce(
        self,
        group: Group,
        flat: torch.Tensor,
        weight: float,
        residual: torch.Tensor | None = None,
        codec_config: CodecConfig | None = None,
        average_residual: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        agreeing: bool = False,
    ) -> tuple[torch.Tensor, RoundReport]:
        """Returns the weighted group average of ``flat`` and a report; never raises for peers' faults.

        ``residual`` (same shape as ``flat``) enables error feedback: what quantization dropped from this
        peer's contributions is added to its next ones. ``codec_config`` overrides ``averaging.codec`` for
        this round (e.g. lossless for parameters). ``average_residual`` (same shape) does the same for the
        averages this peer codes as a reducer, the second quantization every element goes through.
        ``out`` (same shape, not overlapping ``flat``) receives the average and is returned; a caller that
        averages every step passes the same buffer each time, since a fresh model-sized tensor costs a page
        fault per 4 KiB on every round. ``agreeing``: honest members send identical rows (one state's
        parameters), so a robust rule counts identical rows as members, not as one sybil's copies.
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
        if out is None:
            result = torch.empty_like(flat)
        elif out.shape != flat.shape or out.dtype != flat.dtype:
            raise ValueError(f"out must be a {flat.dtype} tensor of shape {tuple(flat.shape)}, got "
                             f"{out.dtype} {tuple(out.shape)}")
        elif out.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
            # flat is read chunk by chunk while averages land: writing into it would corrupt contributions
            raise ValueError("out must not share memory with flat")
        else:
            result = out
        start, end = spans[rank]
        # Nothing span-sized happens before the first chunk leaves: sums start chunk by chunk in `result`.
        reducer = SpanReducer(
            group, rank, flat[start:end], weight, self.config, codec_config, self.peer_id, result[start:end],
            average_residual[start:end] if average_residual is not None else None,
            residual[start:end] if residual is not None else None, agreeing,
        )
        async with self._round_registered:
            self._reducers[group.round_id] = reducer
            self._round_registered.notify_all()
        try:
            exchanges = [
                SpanExchange(self.guard, HANDLER_NAME, group, member, spans[i], flat, weight, residual, result,
                             report, self.config, codec_config).run()
                for i, member in enumerate(group.members)
                if i != rank
            ]
            deadline = self.config.round_timeout
            own = asyncio.ensure_future(reducer.finish(deadline))
            await asyncio.wait_for(asyncio.gather(own, *exchanges), deadline + self.config.join_timeout + 5.0)
            await reducer.answered(self.config.join_timeout)
            report.excluded.update(reducer.excluded)
            report.aggregation, report.clipped = reducer.rule, reducer.clipped
            report.bytes_sent += reducer.bytes_sent
            report.bytes_received += reducer.bytes_received
        finally:
            self._reducers.pop(group.round_id, None)
            reducer.close()
        report.duration = time.monotonic() - started
        return result, report

    # --- serving other members ------------------------------------------------------------------------------

    async def _handle_stream(
        self, info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sender = str(getattr(info, "peer_id", "?"))
        try:
            # a member that opens a stream and sends nothing must not hold its slot for long
            request = await asyncio.wait_for(read_message(reader, pb.ReduceRequest, sender),
                                             self.config.join_timeout)
            reducer = await self._wait_for_round(request.round_id)
            if reducer is None:
                await write_message(
                    writer, pb.ReduceResponse(code=pb.UNKNOWN_ROUND, message="not in this round")
                )
                await wait_for_close(reader)  # its chunks may follow the request: closing now could drop this
                return
            await reducer.serve(sender, request, reader, writer)
        except ProtocolViolation as e:
            logger.warning("Dropping averaging stream from %s: %s", sender, e)
        except (ConnectionError, asyncio.IncompleteReadError, OSError, TimeoutError) as e:
            logger.info("Averaging stream from %s broke: %r", sender, e)
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
            except TimeoutError:
                return None
            return self._reducers[round_id]
