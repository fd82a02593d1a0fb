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

No member takes a reducer's word for its average: each checks every span it gets back against what the
members sent, with randomness no reducer can predict (verify/), and applies only what checks out; a span that
fails keeps this peer's own values, like a span whose reducer failed. A peer caught lying is banned (a local,
bounded, expiring list) on evidence: left out of every later group this peer averages in and refused on every
stream; the evidence goes to the round's other members (evidence.py), who check it themselves.

A member this peer waited out in a recent round (it sent nothing, or never answered as a reducer) is watched
(absences.py): it gets a grace beyond the rest of the round (as long again as the rest took, at most
``averaging.join_timeout``), not the round's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

import torch

from peerd.averaging.absences import Absences, grace
from peerd.averaging.audits import Audits
from peerd.averaging.evidence import EvidenceDesk
from peerd.averaging.group import Group, RoundReport, is_state_round
from peerd.averaging.layout import split_spans
from peerd.averaging.reducer import SpanReducer
from peerd.averaging.requests import PROTOCOL_VERSION
from peerd.averaging.sender import SpanExchange
from peerd.averaging.serving import SenderStream
from peerd.averaging.settle import settle
from peerd.averaging.verify.bans import BanList
from peerd.averaging.verify.keys import Identity, KeyBook, SigningKey
from peerd.averaging.verify.payloads import checks_averages
from peerd.averaging.verify.proofs import Evidence
from peerd.averaging.verify.record import SpanRecord
from peerd.averaging.verify.round import RoundVerification
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

    def __init__(self, guard: StreamGuard, config: AveragingConfig, identity: Identity) -> None:
        """``guard``: every stream, served or opened, passes its membership handshake and limits first;
        ``identity``: this peer's libp2p identity, which certifies the key it signs round messages with."""
        if identity.peer_id != guard.peer_id:
            raise ValueError(f"identity {identity.peer_id} is not this peer's ({guard.peer_id})")
        self.guard = guard
        self.config = config
        self.peer_id = guard.peer_id
        self.signing = SigningKey(identity)
        self.keys = KeyBook()
        self.bans = BanList(config.verification)
        self.absences = Absences()
        self.evidence = EvidenceDesk(guard, config, self.keys, self.bans)
        self._reducers: dict[str, SpanReducer] = {}
        self._round_registered = asyncio.Condition()
        self._sent: dict[int, torch.Tensor] = {}  # by numel: what members decode of our contributions
        self.audits = Audits()  # of spans that passed, after their round

    async def start(self) -> None:
        if not checks_averages(self.config.codec, self.config.verification.check_narrow_codes):
            logger.warning("averaging.codec.scheme %s with averaging.verification.check_narrow_codes off: reducers' "
                           "averages coded that way carry error feedback no member can bound, so this peer applies "
                           "them unchecked (a lying reducer is not caught in these rounds; docs/security.md, "
                           "verified reductions)", self.config.codec.scheme)
        await self.guard.add_handler(HANDLER_NAME, self._handle_stream)
        await self.evidence.start()

    async def stop(self) -> None:
        await self.guard.remove_handler(HANDLER_NAME)
        await self.audits.stop()
        await self.evidence.stop()

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
    ) -> tuple[torch.Tensor, RoundReport]:
        """Returns the weighted group average of ``flat`` and a report; never raises for peers' faults.

        ``residual`` (same shape as ``flat``) enables error feedback: what quantization dropped from this
        peer's contributions is added to its next ones. ``codec_config`` overrides ``averaging.codec`` for
        this round (e.g. lossless for parameters). ``average_residual`` (same shape) does the same for the
        averages this peer codes as a reducer, the second quantization every element goes through.
        ``out`` (same shape, not overlapping ``flat``) receives the average and is returned; a caller that
        averages every step passes the same buffer each time, since a fresh model-sized tensor costs a page
        fault per 4 KiB on every round. In a state round (``is_state_round``) honest members send
        identical rows (one state's parameters), so a robust rule counts identical rows as members, not as one
        sybil's copies. Raises GroupFailed only if this peer is not a member.
        """
        codec_config = codec_config or self.config.codec
        if self.peer_id not in group.members:
            raise GroupFailed(f"{self.peer_id} is not a member of round {group.round_id}")
        report = RoundReport(group.round_id, len(group.members))
        group = self._without_banned(group, report)
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be finite and positive, got {weight}")
        if flat.dim() != 1 or flat.dtype != torch.float32:
            raise ValueError("all_reduce takes a flat float32 tensor")  # the codec refuses NaN/Inf as it encodes
        started = time.monotonic()
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
        config = self.config.model_copy(update={"codec": codec_config})
        sent = self._sent_buffer(flat.numel())
        watched = self.absences.watched(group.members)
        verification = RoundVerification(group, rank, self.signing, self.keys, config, spans, result,
                                         self._accuser(group, report))
        verification.own_weight = weight
        record = SpanRecord(verification, end - start, self.config.aggregation, weight, sent[start:end])
        # Nothing span-sized happens before the first chunk leaves: sums start chunk by chunk in `result`.
        reducer = SpanReducer(
            group, rank, flat[start:end], weight, self.config, codec_config, self.peer_id, result[start:end],
            record, average_residual[start:end] if average_residual is not None else None,
            residual[start:end] if residual is not None else None,
            is_state_round(group.round_id), frozenset(watched),
        )
        async with self._round_registered:
            self._reducers[group.round_id] = reducer
            self._round_registered.notify_all()
        exchanges = [
            SpanExchange(self.guard, HANDLER_NAME, group, member, spans[i], flat, weight, residual, result,
                         report, config, codec_config, verification, sent)
            for i, member in enumerate(group.members)
            if i != rank
        ]
        try:
            # the exchanges' verification waits for the other members: up to a few verification timeouts more
            limit = self.config.round_timeout + self.config.join_timeout + 5.0 + 6 * self.config.verification.timeout
            await asyncio.wait_for(self._exchange(reducer, exchanges, watched), limit)
            await reducer.answered(self.config.join_timeout)
            late = {e.member: "never answered as the reducer of its span" for e in exchanges if e.late}
            late.update({m: "sent no complete contribution to this peer's span in time" for m in reducer.late})
            self.absences.note(group, self.peer_id, late, reducer.excluded)
            settle(verification, flat, result, spans, report, exchanges)
            report.excluded.update(reducer.excluded)
            report.aggregation, report.clipped = reducer.rule, reducer.clipped
            report.bytes_sent += reducer.bytes_sent
            report.bytes_received += reducer.bytes_received
            report.check_bytes_sent += reducer.check_bytes_sent
            report.check_bytes_received += reducer.check_bytes_received
        finally:
            self._reducers.pop(group.round_id, None)
            reducer.close()
            for exchange in exchanges:
                if exchange.audit_stream is not None:
                    self.audits.start(exchange)
        report.duration = time.monotonic() - started
        return result, report

    async def _exchange(self, reducer: SpanReducer, exchanges: list[SpanExchange], watched: set[str]) -> None:
        """Runs this peer's span and its exchanges. Once every other span's averages are in, a watched reducer
        that fell behind with its contribution to our span in this very round is given up on at once, and the
        other watched ones get a ``grace`` for their averages."""
        runs = [asyncio.ensure_future(reducer.finish(self.config.round_timeout)),
                *(asyncio.ensure_future(exchange.run()) for exchange in exchanges)]
        later = [exchange for exchange in exchanges if exchange.member in watched]
        try:
            if later:
                await asyncio.gather(runs[0], *(e.exchanged.wait() for e in exchanges if e.member not in watched))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(grace(time.monotonic() - reducer.began, self.config.join_timeout)):
                        await asyncio.gather(*(e.exchanged.wait() for e in later if e.member not in reducer.late))
                for exchange in later:
                    if not exchange.exchanged.is_set():
                        exchange.give_up.set()
            await asyncio.gather(*runs)
        finally:
            for task in runs:
                task.cancel()

    def _sent_buffer(self, numel: int) -> torch.Tensor:
        """A reused buffer per tensor size (gradients, state): a fresh one costs a page fault per 4 KiB."""
        buffer = self._sent.get(numel)
        if buffer is None:
            if len(self._sent) >= 4:
                self._sent.clear()
            buffer = self._sent[numel] = torch.empty(numel)
        return buffer

    def _without_banned(self, group: Group, report: RoundReport) -> Group:
        """``group`` without the peers this one has banned (every member holding the same evidence leaves them
        out alike, so the rest still agree on the spans)."""
        members = []
        for member in group.members:
            reason = self.bans.reason(member) if member != self.peer_id else None
            if reason is None:
                members.append(member)
            else:
                report.excluded[member] = reason
        if len(members) < 2:
            raise GroupFailed(f"round {group.round_id}: every other member is banned ({', '.join(report.excluded)})")
        return group if len(members) == len(group.members) else Group(group.round_id, tuple(members))

    def _accuser(self, group: Group, report: RoundReport) -> Callable[[str, str, Evidence | None, bool], None]:
        def accuse(peer: str, reason: str, evidence: Evidence | None, proven: bool) -> None:
            report.accused[peer] = reason
            if self.bans.ban(peer, reason, proven) and evidence is not None:
                self.evidence.push([m for m in group.members if m not in (peer, self.peer_id)], evidence)

        return accuse

    # --- serving other members ------------------------------------------------------------------------------

    async def _handle_stream(
        self, info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sender = str(getattr(info, "peer_id", "?"))
        try:
            # a member that opens a stream and sends nothing must not hold its slot for long
            request = await asyncio.wait_for(read_message(reader, pb.ReduceRequest, sender),
                                             self.config.join_timeout)
            banned = self.bans.reason(sender)
            if banned is not None:
                await write_message(writer, pb.ReduceResponse(code=pb.NOT_A_MEMBER, message=banned[:300]))
                await wait_for_close(reader)
                return
            reducer = await self._wait_for_round(request.round_id)
            if reducer is None:
                await write_message(
                    writer, pb.ReduceResponse(code=pb.UNKNOWN_ROUND, message="not in this round")
                )
                await wait_for_close(reader)  # its chunks may follow the request: closing now could drop this
                return
            await SenderStream(reducer, sender, reader, writer).run(request)
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
