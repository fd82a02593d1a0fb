"""One round's verification at one member: its seed shares, what it gathers (statements from reducers on its own
streams, seed shares and samples from members on the streams they opened to it), its verdict on every span it
received, and what it keeps of its own rows for its samples.

Everything after the data phase goes span by span: a member reveals its share of a span once it holds that
span's statement, draws the span's seed once every member's share of it is in, and sends its samples of its row
in that span then; a span is judged once every included member's samples of it are in. So the first spans'
checks run while the last ones are still averaged, and the round's end waits only for the last span's.

A span is applied only if its statement and every included member's samples check out (checks.py); a chunk a
statement marks void is applied by nobody. Everything else keeps this member's own values, as a span whose
reducer failed always has.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import torch
from google.protobuf.message import DecodeError

from peerd.averaging.group import Group, is_state_round
from peerd.averaging.layout import chunk_bounds
from peerd.averaging.verify.keys import KeyBook, SigningKey
from peerd.averaging.verify.proofs import Evidence, equivocation, two_averages
from peerd.averaging.verify.randomness import RoundRandomness, commitment, new_share, span_seed
from peerd.averaging.verify.samples import MemberSamples, OwnRow, parse_samples, row_samples, sign_samples
from peerd.averaging.verify.statement import Statement, parse_statement
from peerd.averaging.verify.verdict import Held, Verdict, span_verdict
from peerd.config import AveragingConfig
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb

__all__ = ["Accuse", "RoundVerification"]

logger = logging.getLogger(__name__)

_AUDIT = random.SystemRandom()


Accuse = Callable[[str, str, Evidence | None, bool], None]
T = TypeVar("T")


def _shared(started: dict[int, asyncio.Future[T]], span: int, start: Callable[[int], Coroutine[Any, Any, T]]
            ) -> Awaitable[T]:
    """``start(span)``, run once however many wait for it; shielded, so that one waiter given up cancels nothing."""
    if span not in started:
        started[span] = asyncio.ensure_future(start(span))
    return asyncio.shield(started[span])


class RoundVerification:
    def __init__(self, group: Group, rank: int, signing: SigningKey, keys: KeyBook, config: AveragingConfig,
                 spans: list[tuple[int, int]], result: torch.Tensor, accuse: Accuse) -> None:
        """``result``: the all-reduce's result, where the averages this member received land; ``accuse(peer,
        reason, evidence, proven)``: what to do with a peer found lying (evidence None: nothing to show)."""
        self.group, self.rank, self.signing, self.keys, self.config = group, rank, signing, keys, config
        self.result, self.accuse = result, accuse
        chunk_numel = config.chunk_numel
        self.me = group.members[rank]
        self.spans, self.chunk_numel = spans, chunk_numel
        self.layout = {s: chunk_bounds(end - start, chunk_numel) for s, (start, end) in enumerate(spans)}
        self.own_shares = [new_share() for _ in spans]  # one a span
        self.commitments_out = [commitment(share) for share in self.own_shares]
        self.commitments: dict[str, list[bytes]] = {}  # first-hand, from the members' requests to this peer
        self.shares: dict[int, dict[str, bytes]] = {s: {self.me: share} for s, share in enumerate(self.own_shares)}
        self.statements: dict[int, Statement] = {}
        self.problems: dict[int, str] = {}  # span -> why it has no usable statement
        self.stated: set[int] = set()  # spans whose statement this member holds, or never will
        self.revealed: set[int] = set()  # spans whose seed share this member sent out
        self.own_rows: dict[int, OwnRow] = {}
        self.rows_done: set[int] = set()  # spans whose contribution this member finished sending (or gave up on)
        self.own_hashes: dict[int, list[bytes]] = {}
        self.own_weight = 0.0
        # span -> chunk -> (payload, the reducer's signature, blake3 of the payload)
        self.outputs: dict[int, dict[int, tuple[bytes, bytes, bytes]]] = {}
        self.output_norms: dict[int, dict[int, torch.Tensor]] = {}  # span -> chunk -> block norms, as it came
        self.samples: dict[int, dict[str, MemberSamples]] = {}  # span -> member -> its samples there, parsed
        self.unparsed: dict[tuple[str, int], pb.Signed] = {}  # (member, span) -> its samples there, as they came
        self.parsing: dict[tuple[str, int], asyncio.Future[MemberSamples | str]] = {}
        self.with_sketch = config.aggregation != "mean"  # robust rules: distances, norms and copies
        self.verdicts: dict[int, Verdict] = {}
        self.own_void: list[int] = []
        # set once this member's own span is averaged: every member that will contribute has sent its request
        # (and commitments) by then, so the set of shares each seed needs is final
        self.settled = asyncio.Event()
        self._changed = asyncio.Condition()
        self._reveals: dict[int, asyncio.Future[bytes]] = {}
        self._randomness: dict[int, asyncio.Future[RoundRandomness]] = {}
        self._mine: dict[int, asyncio.Future[pb.Signed | None]] = {}

    # --- gathering ----------------------------------------------------------------------------------------------

    def note_request(self, member: str, request: pb.ReduceRequest) -> None:
        commitments = [bytes(c) for c in request.seed_commitments]
        if len(commitments) == len(self.spans) and all(len(c) == 32 for c in commitments):
            self.commitments.setdefault(member, commitments)

    async def reveal_from(self, member: str, span: int, share: bytes) -> None:
        committed = self.commitments.get(member)
        if committed is None or span >= len(committed) or committed[span] != commitment(share):
            raise ProtocolViolation(f"{member}'s seed share of span {span} does not match its commitment",
                                    peer_id=member)
        await self._note(lambda: self.shares[span].setdefault(member, share))

    async def statement_from(self, span: int, signed: pb.Signed) -> None:
        start, end = self.spans[span]
        try:
            if span in self.revealed:  # its reducer may have learnt its seed before it committed (see reveal)
                self.problems[span] = "its statement came after this member revealed its seed share of the span"
                return
            self.statements[span] = parse_statement(signed, self.group, span, end - start, self.chunk_numel,
                                                    self.keys)
        except ProtocolViolation as e:
            self.problems[span] = e.message
            raise
        finally:
            await self.no_statement(span)

    async def no_statement(self, span: int) -> None:
        """Span ``span``'s statement is in this member's hands (its own span's: signed), or never will be (its
        exchange ended first)."""
        await self._note(lambda: self.stated.add(span))

    def reveal(self, span: int) -> Awaitable[bytes]:
        """This member's seed share of span ``span``, once it holds that span's statement (or knows it never
        will, or the verification timeout passed). Revealed before, the share could let the span's reducer (or
        one it colludes with, done first) draw the span's seed before it commits: told the seed, it could lie
        wherever no sample falls. A statement that comes later is not believed."""
        return _shared(self._reveals, span, self._reveal)

    async def _reveal(self, span: int) -> bytes:
        if not await self._until(lambda: span in self.stated):
            logger.warning("Round %s: no statement of span %d from %s within %.0f s; revealing this member's seed "
                           "share of it without one", self.group.round_id, span, self.group.members[span],
                           self.config.verification.timeout)
        self.revealed.add(span)
        return self.own_shares[span]

    async def row_sealed(self, span: int, row: OwnRow, hashes: list[bytes]) -> None:
        """This member's contribution to span ``span`` is sent, and sealed with these chunk ``hashes``."""
        def note() -> None:
            self.own_rows[span], self.own_hashes[span] = row, hashes
        await self._note(note)

    async def row_done(self, span: int) -> None:
        """This member's exchange with span ``span``'s reducer is over: its averages are in, or never will be."""
        await self._note(lambda: self.rows_done.add(span))

    async def samples_from(self, member: str, signed: pb.Signed) -> None:
        """``member``'s samples of one span (which the message names); read once that span's seed is drawn."""
        try:
            spans = pb.MemberSamples.FromString(signed.body).spans
        except DecodeError as e:
            raise ProtocolViolation(f"{member} sent samples that do not parse: {e}", peer_id=member) from e
        if len(spans) != 1 or spans[0].span_index >= len(self.spans):
            raise ProtocolViolation(f"{member} sent samples of {len(spans)} spans, not of one span of the round",
                                    peer_id=member)
        key = (member, spans[0].span_index)
        first = self.unparsed.setdefault(key, signed)
        if key not in self.parsing:  # read as it comes, off the event loop, while the others are awaited
            self.parsing[key] = asyncio.ensure_future(self._parse(member, key[1], first))
        await self._note(lambda: None)

    async def _parse(self, member: str, span: int, signed: pb.Signed) -> MemberSamples | str:
        """``member``'s samples of span ``span``, or why they are not samples of this round's row there."""
        seed = (await self.randomness(span)).seed
        try:
            return await asyncio.to_thread(parse_samples, signed, member, self.group.round_id, seed,
                                           {span: self.layout[span]}, self.config.codec.block_size, self.keys)
        except ProtocolViolation as e:
            return e.message

    async def _note(self, change: Callable[[], object]) -> None:
        async with self._changed:
            change()
            self._changed.notify_all()

    async def _until(self, ready: Callable[[], bool], timeouts: int = 1) -> bool:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(ready), timeouts * self.config.verification.timeout)
            except TimeoutError:
                return ready()
        return True

    # --- the seeds and this member's samples -------------------------------------------------------------------

    def randomness(self, span: int) -> Awaitable[RoundRandomness]:
        return _shared(self._randomness, span, self._draw)

    async def _draw(self, span: int) -> RoundRandomness:
        """Span ``span``'s seed from the shares of every member that committed to them in a request to this peer (a
        member that never reached it is in no average here); after the timeout, from the shares revealed so far:
        a member that commits and never reveals delays the span's checks, it cannot stop them."""
        try:
            await asyncio.wait_for(self.settled.wait(), self.config.round_timeout + self.config.verification.timeout)
        except TimeoutError:
            pass
        expected = set(self.commitments) | {self.me}
        # a member reveals its share once it holds the span's statement, or after one timeout: two here
        if not await self._until(lambda: set(self.shares[span]) >= expected, 2):
            logger.warning("Round %s: no seed share of span %d from %s within %.0f s; drawing from the others'",
                           self.group.round_id, span, ", ".join(sorted(expected - set(self.shares[span]))),
                           2 * self.config.verification.timeout)
        shares = {member: self.shares[span][member] for member in expected if member in self.shares[span]}
        return RoundRandomness(span_seed(self.group.round_id, span, shares), self.chunk_numel)

    def my_samples(self, span: int) -> Awaitable[pb.Signed | None]:
        """This member's signed samples of its row in span ``span`` (None: it has no row there)."""
        return _shared(self._mine, span, self._build_mine)

    async def _build_mine(self, span: int) -> pb.Signed | None:
        randomness = await self.randomness(span)  # after settled: this member's own row is in own_rows by then
        if span != self.rank:  # a row is sealed once its last chunk is out, before its averages are in
            await self._until(lambda: span in self.own_rows or span in self.rows_done)
        if span not in self.own_rows:
            return None
        rows = await asyncio.to_thread(row_samples, self.signing, self.group.round_id, randomness,
                                       {span: self.own_rows[span]}, self.with_sketch)
        if span != self.rank:
            await self._until(lambda: span in self.rows_done)
        signed = sign_samples(self.signing, rows, self.outputs)  # a hash and a signature a chunk: no thread hop
        await self.samples_from(self.me, signed)
        return signed

    # --- verdicts -----------------------------------------------------------------------------------------------

    async def verdict(self, span: int) -> Verdict:
        """Whether span ``span``'s average may be applied (asked once per span, by its exchange)."""
        verdict = await self._judge(span)
        self.verdicts[span] = verdict
        if not verdict.apply:
            logger.warning("Round %s: the average of span %d from %s is not applied: %s", self.group.round_id,
                           span, self.group.members[span], verdict.reason)
        return verdict

    async def _judge(self, span: int) -> Verdict:
        statement = self.statements.get(span)
        if statement is None:
            return Verdict(False, self.problems.get(span, "no statement from its reducer"))
        randomness = await self.randomness(span)
        await self.my_samples(span)
        needed = {self.group.members[r] for chunk in statement.chunks if not chunk.void for r in chunk.included}
        await self._until(lambda: {m for m, s in self.unparsed if s == span} >= needed)
        problems: dict[str, str] = {}
        held = self.samples.setdefault(span, {})
        for (member, of), parsing in sorted(self.parsing.items()):
            if of != span:
                continue
            parsed = await parsing
            if isinstance(parsed, str):
                problems[member] = parsed
            else:
                held.setdefault(member, parsed)
        for stated in held.values():
            self._compare_outputs(stated, span)
        missing = sorted(needed - set(held))
        if missing:
            return Verdict(False, "; ".join(problems.get(m, f"no samples from {m}") for m in missing))
        started = time.monotonic()
        verdict = await asyncio.to_thread(self._check, statement, randomness)
        logger.debug("Round %s: span %d checked in %.1f ms", self.group.round_id, span,
                     1000 * (time.monotonic() - started))
        checked = [i for i, chunk in enumerate(statement.chunks) if not chunk.void and i not in verdict.unchecked]
        if verdict.apply and verdict.challenge is None and checked and \
                _AUDIT.random() < self.config.verification.audit_probability:
            verdict.challenge = _AUDIT.choice(checked)  # drawn here, after the seed: nobody can foresee it
        return verdict

    def _compare_outputs(self, member: MemberSamples, span: int) -> None:
        """Convicts span ``span``'s reducer if it signed another average of a chunk for ``member`` than for
        this member."""
        stated, statement, mine = member.spans.get(span), self.statements[span], self.outputs.get(span, {})
        for index, theirs in enumerate(stated.outputs if stated is not None else []):
            if index not in mine or mine[index][2] == theirs[0]:
                continue
            ours = (mine[index][2], mine[index][1])
            why = two_averages(statement, index, ours, theirs, self.keys)
            if why is not None:
                self.accuse(statement.reducer, why, equivocation(statement, index, ours, theirs), True)
                return

    def _check(self, statement: Statement, randomness: RoundRandomness) -> Verdict:
        span = statement.span
        start, end = self.spans[span]
        held = Held(self.rank, self.outputs.get(span, {}), self.output_norms.get(span, {}), self.result[start:end],
                    self.layout[span], self.own_rows.get(span), self.own_hashes.get(span, []), self.own_weight)
        by_rank = {self.group.rank_of(m): s for m, s in self.samples.get(span, {}).items()}
        return span_verdict(statement, by_rank, held, randomness, self.config, is_state_round(self.group.round_id))
