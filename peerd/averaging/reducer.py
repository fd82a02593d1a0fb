"""The reducer of one span in one round: validates contributions chunk by chunk and averages each chunk as
soon as every member still in the round has delivered it, so averages flow back while contributions still
arrive. A member whose chunk fails validation, whose stream breaks or who is too slow is excluded from the
rest of the round; its earlier, valid chunks stay in their averages. Nothing invalid is ever added.

Every member checks what it gets back (verify/): the reducer codes its own row like any contribution, signs
each averaged chunk, records how each was made (verify/record.py) and signs a statement of it after the last
chunk; its carried quantization residual is kept within half a codec step of the average it codes, so members
can bound how far an honest coded average may be from the exact one.

With ``averaging.aggregation: mean`` each chunk's running sum lives in the caller's result slice and starts
when the chunk is first touched, so a round does no span-sized work before its first chunk leaves (the
uplink would sit idle meanwhile). A robust rule keeps every member's decoded chunk instead and combines
them once all are in (robust.py): the rule needs them together, and combining in rank order makes the result
independent of arrival order."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import torch

from peerd.averaging.absences import grace
from peerd.averaging.compute import run_chunk_work
from peerd.averaging.group import Clipping, Group
from peerd.averaging.layout import chunk_bounds
from peerd.averaging.requests import SpanView
from peerd.averaging.robust import RobustChunks, rule_label
from peerd.averaging.verify.payloads import block_norms, code_average, envelope, scheme_of, sent_count
from peerd.averaging.verify.record import SpanRecord
from peerd.config import AveragingConfig, CodecConfig
from peerd.errors import ProtocolViolation
from peerd.wire import codec
from peerd.wire.feedback import readd_left_out

logger = logging.getLogger(__name__)

RAW = CodecConfig(lossless=True, error_feedback=False)


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
        record: SpanRecord,
        residual: torch.Tensor | None = None,
        own_residual: torch.Tensor | None = None,
        agreeing: bool = False,
        watched: frozenset[str] = frozenset(),
    ) -> None:
        """``out`` receives the coded average of the span (the caller's slice of its result); ``record`` keeps
        what the span's statement and challenges need (this peer's own row is coded into ``record.own_row``);
        ``residual``, if given, carries what coding the average dropped into this peer's next average of the
        same elements; ``own_residual``, if given, is added to ``own`` before it is coded, and receives what
        coding drops of it, as a sender's residual does. ``agreeing``: the members' rows are meant to be
        identical (aggregation.combine). ``watched``: members seen absent lately (absences.py), each waited for
        a ``grace`` a chunk beyond the rest, not the round's timeout."""
        self.residual, self.own_residual = residual, own_residual
        self.record = record
        self.group, self.rank, self.config, self.codec_config = group, rank, config, codec_config
        self.peer_id, self.out, self.own, self.own_weight = peer_id, out, own, weight
        self.numel = own.numel()
        self.chunks = chunk_bounds(self.numel, config.chunk_numel)
        self.view = SpanView(group, peer_id, rank, self.numel, config.chunk_numel)
        senders = set(group.members) - {peer_id}
        self.expected = senders
        self.pending = [set(senders) for _ in self.chunks]  # whose chunk k we still wait for
        self.weights = [weight for _ in self.chunks]
        self.claims = {peer_id: weight}  # the weight each member's rows entered the mean with
        self.included: list[set[str]] = [{peer_id} for _ in self.chunks]
        self.counts = [0 for _ in self.chunks]  # the most elements an included top-k row carries, per chunk
        self.payloads: list[bytearray | None] = [None for _ in self.chunks]
        self.ready = [asyncio.Event() for _ in self.chunks]
        self.excluded: dict[str, str] = {}
        self.late: set[str] = set()  # excluded for keeping the span waiting: at its timeout, or a watched one
        self.watched = watched & senders
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self.began = time.monotonic()  # the round's start, from which watched members' grace is measured
        self.serving: set[str] = set()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.check_bytes_sent = 0  # the verification's (group.RoundReport)
        self.check_bytes_received = 0
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
        self._watch(0)

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
            if index + 1 < len(self.chunks):
                self._watch(index + 1)

    def _watch(self, index: int) -> None:
        """Gives the watched members a ``grace`` for chunk ``index`` once only they are missing from it and the
        chunk before is averaged: one that trails the rest by more is left out, as the timeout would."""
        waiting = self.pending[index]
        if (not waiting or not waiting <= self.watched or index in self._timers or self._closed
                or index > 0 and not self.ready[index - 1].is_set()):
            return
        wait = grace(time.monotonic() - self.began, self.config.join_timeout)
        self._timers[index] = asyncio.get_running_loop().call_later(wait, self._behind, index, wait)

    def _behind(self, index: int, wait: float) -> None:
        for sender in sorted(self.pending[index] & self.watched):
            self.late.add(sender)
            self.exclude(sender, f"seen absent lately, and still {wait:.1f}s behind the rest with chunk {index}")

    def _start(self, index: int) -> None:
        """Seeds chunk ``index``'s sum with this peer's weighted row, once; under ``_sum_lock``."""
        if self._started[index]:
            return
        start, end = self.chunks[index]
        torch.mul(self._own_row(index), self.own_weight, out=self.out[start:end])
        self._started[index] = True

    def _own_row(self, index: int) -> torch.Tensor:
        """This peer's row of chunk ``index``: its values plus its carried residual, exactly (the residual is
        zeroed, and takes back what a SPARSE8 average leaves out of the row), in ``record.own_row``; the record
        keeps it as a lossless payload, which the statement's signature binds (hashing its 4 bytes an element
        costs less than coding it)."""
        start, end = self.chunks[index]
        row = self.record.own_row[start:end]
        carried = self.own_residual[start:end] if self.own_residual is not None else None
        if carried is not None:
            torch.add(self.own[start:end], carried, out=row)
            carried.zero_()
        else:
            row.copy_(self.own[start:end])
        payload = codec.encode(row, RAW)
        block = self.codec_config.block_size
        self.record.own(index, payload, envelope(None, row, block), block_norms(row, block))  # nobody writes to it
        return row

    def _average_chunk(self, index: int) -> bytearray:
        start, end = self.chunks[index]
        with self._sum_lock:  # after this, _add refuses the chunk (it is in _finalizing)
            included = set(self.included[index])
            if self.robust is None:
                self._start(index)
                average = self.out[start:end].div_(self.weights[index])
            else:
                self.robust.row(index, self.peer_id, end - start).copy_(self._own_row(index))
        if self.robust is not None:
            average = self.out[start:end]
            members, combined = self.robust.combine(index, included, end - start, average)
            self.weights[index] = sum(combined.weights)
            self.record.combined(index, members, combined.coefficients, combined)
        else:
            members = [m for m in self.group.members if m in included]
            claims = [self.claims[m] for m in members]
            self.record.combined(index, members, [c / sum(claims) for c in claims])
        # coded as members can check it (verify/payloads.py), decoded in place: every member applies the same
        payload = code_average(average, self.residual[start:end] if self.residual is not None else None,
                               self.codec_config, self.config.verification.check_narrow_codes, self.peer_id,
                               self.counts[index])
        if self.own_residual is not None and scheme_of(payload) is codec.Scheme.SPARSE8:
            readd_left_out(self.own_residual[start:end], self.record.own_row[start:end], average)
        self.record.sign_output(index, payload)
        return payload

    def exclude(self, sender: str, reason: str) -> None:
        if sender in self.excluded or self._closed:
            return
        self.excluded[sender] = reason
        logger.warning("Round %s: excluded %s from span %d: %s", self.group.round_id, sender, self.rank, reason)
        for index, waiting in enumerate(self.pending):
            waiting.discard(sender)
            self._maybe_finalize(index)
            self._watch(index)

    async def finish(self, timeout: float) -> None:
        """Waits until every chunk is averaged and the span's statement signed; after ``timeout`` the members
        still missing are excluded."""
        try:
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in self.ready)), timeout)
        except TimeoutError:
            for sender in sorted(set().union(*self.pending)):
                self.late.add(sender)
                self.exclude(sender, f"contribution incomplete after {timeout:.1f}s")
            await asyncio.gather(*(event.wait() for event in self.ready))
        if self.robust is not None:
            self.robust.log(len(self.chunks))
        await self.record.statement(self.ready)  # also when no sender is left to send it to

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
        for timer in self._timers.values():
            timer.cancel()
        for task in self._tasks:
            task.cancel()
        for event in self.ready:
            event.set()

    # --- one sender's chunks (its stream: serving.py) ------------------------------------------------------------

    def answered_by(self, sender: str) -> None:
        """``sender`` has been sent every average this reducer had for it."""
        self._answered.add(sender)
        if self._answered | set(self.excluded) >= self.expected:
            self._all_answered.set()

    def add(self, data: bytes, sender: str, weight: float, index: int, scratch: torch.Tensor) -> None:
        """Decodes ``sender``'s chunk ``index`` and adds it (its row, for a robust rule); in a worker thread
        for large chunks."""
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
                self.counts[index] = max(self.counts[index], sent_count(data))
            return
        chunk = scratch[: end - start]
        codec.decode(data, peer_id=sender, expected_shape=(end - start,), max_numel=end - start, out=chunk)
        with self._sum_lock:  # sum, weight and membership change together, or not at all
            self._check_open(index, sender)
            self._start(index)
            self.out[start:end].add_(chunk, alpha=weight)
            self.weights[index] += weight
            self.claims[sender] = weight
            self.included[index].add(sender)
            self.counts[index] = max(self.counts[index], sent_count(data))

    def _check_open(self, index: int, sender: str) -> None:
        """Under ``_sum_lock``: ProtocolViolation if chunk ``index`` is already being averaged."""
        if index in self._finalizing:
            raise ProtocolViolation(f"{sender}'s chunk {index} arrived after it was averaged", peer_id=sender)

    def added(self, done: asyncio.Future[None], sender: str, index: int) -> None:
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            self.exclude(sender, str(error))
            return
        self.pending[index].discard(sender)
        self._maybe_finalize(index)
        self._watch(index)
