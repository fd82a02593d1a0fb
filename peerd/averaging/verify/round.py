"""One round's verification at one member: its seed share, what it gathers (statements from reducers on its own
streams, seed shares and samples from members on the streams they opened to it), its verdict on every span it
received, and what it keeps of its own rows for its samples.

A span is applied only if its statement and every included member's samples check out (checks.py); a chunk a
statement marks void is applied by nobody. Everything else keeps this member's own values, as a span whose
reducer failed always has.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

import torch

from peerd.averaging.group import Group, is_state_round
from peerd.averaging.layout import chunk_bounds
from peerd.averaging.verify.disputes import judge_chunk, output_signed
from peerd.averaging.verify.keys import KeyBook, SigningKey
from peerd.averaging.verify.proofs import Evidence, bad_reduction, equivocation, false_samples, two_averages
from peerd.averaging.verify.randomness import RoundRandomness, commitment, new_share, round_seed
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
        self.share = new_share()
        self.commitment = commitment(self.share)
        self.commitments: dict[str, bytes] = {}  # first-hand, from the members' requests to this peer
        self.shares: dict[str, bytes] = {self.me: self.share}
        self.statements: dict[int, Statement] = {}
        self.problems: dict[int, str] = {}  # span -> why it has no usable statement
        self.stated: set[int] = set()  # spans whose statement this member holds, or never will
        self.revealed = False  # whether this member's seed share went out to any reducer
        self.own_rows: dict[int, OwnRow] = {}
        self.rows_done: set[int] = set()  # spans whose contribution this member finished sending (or gave up on)
        self.own_hashes: dict[int, list[bytes]] = {}
        self.own_weight = 0.0
        # span -> chunk -> (payload, the reducer's signature, blake3 of the payload)
        self.outputs: dict[int, dict[int, tuple[bytes, bytes, bytes]]] = {}
        self.output_norms: dict[int, dict[int, torch.Tensor]] = {}  # span -> chunk -> block norms, as it came
        self.samples: dict[str, MemberSamples] = {}
        self.unparsed: dict[str, pb.Signed] = {}
        self.parsing: dict[str, asyncio.Future[MemberSamples | str]] = {}
        self.with_sketch = config.aggregation != "mean"  # robust rules: distances, norms and copies
        self.verdicts: dict[int, Verdict] = {}
        self.own_void: list[int] = []
        # set once this member's own span is averaged: every member that will contribute has sent its request
        # (and commitment) by then, so the set of shares the seed needs is final
        self.settled = asyncio.Event()
        self._changed = asyncio.Condition()
        self._randomness: asyncio.Future[RoundRandomness] | None = None
        self._mine: asyncio.Future[pb.Signed] | None = None

    # --- gathering ----------------------------------------------------------------------------------------------

    def note_request(self, member: str, request: pb.ReduceRequest) -> None:
        if len(request.seed_commitment) == 32:
            self.commitments.setdefault(member, bytes(request.seed_commitment))

    async def reveal_from(self, member: str, share: bytes) -> None:
        if self.commitments.get(member) != commitment(share):
            raise ProtocolViolation(f"{member}'s seed share does not match its commitment", peer_id=member)
        await self._note(lambda: self.shares.setdefault(member, share))

    async def statement_from(self, span: int, signed: pb.Signed) -> None:
        start, end = self.spans[span]
        try:
            if self.revealed:  # its reducer may have learnt the seed before it committed (see reveal)
                self.problems[span] = "its statement came after this member revealed its seed share"
                return
            self.statements[span] = parse_statement(signed, self.group, span, end - start, self.chunk_numel,
                                                    self.keys)
        except ProtocolViolation as e:
            self.problems[span] = e.message
            raise
        finally:
            await self.no_statement(span)

    async def no_statement(self, span: int) -> None:
        """Span ``span``'s statement is in this member's hands, or never will be (its exchange ended first)."""
        await self._note(lambda: self.stated.add(span))

    async def reveal(self) -> bytes:
        """This member's seed share, once it holds the statement of every other span of the round (or knows it
        never will, or the verification timeout passed). A share revealed to one reducer as soon as that
        reducer's statement is in would let it draw the seed while another reducer has yet to commit: told the
        seed, that one could lie wherever no sample falls. A statement that comes later is not believed."""
        others = set(range(len(self.spans))) - {self.rank}
        if not await self._until(lambda: self.stated >= others):
            logger.warning("Round %s: no statement from the reducers of spans %s within %.0f s; revealing this "
                           "member's seed share without them", self.group.round_id, sorted(others - self.stated),
                           self.config.verification.timeout)
        self.revealed = True
        return self.share

    async def row_sealed(self, span: int, row: OwnRow, hashes: list[bytes]) -> None:
        """This member's contribution to span ``span`` is sent, and sealed with these chunk ``hashes``."""
        def note() -> None:
            self.own_rows[span], self.own_hashes[span] = row, hashes
        await self._note(note)

    async def row_done(self, span: int) -> None:
        """This member's exchange with span ``span``'s reducer is over: its averages are in, or never will be."""
        await self._note(lambda: self.rows_done.add(span))

    async def samples_from(self, member: str, signed: pb.Signed) -> None:
        first = self.unparsed.setdefault(member, signed)
        if member not in self.parsing:  # read as it comes, off the event loop, while the others are awaited
            self.parsing[member] = asyncio.ensure_future(self._parse(member, first))
        await self._note(lambda: None)

    async def _parse(self, member: str, signed: pb.Signed) -> MemberSamples | str:
        """``member``'s samples, or why they are not samples of this round's rows."""
        seed = (await self.randomness()).seed
        try:
            return await asyncio.to_thread(parse_samples, signed, member, self.group.round_id, seed, self.layout,
                                           self.config.codec.block_size, self.keys)
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

    # --- the seed and this member's samples --------------------------------------------------------------------

    def randomness(self) -> Awaitable[RoundRandomness]:
        if self._randomness is None:
            self._randomness = asyncio.ensure_future(self._draw())
        return self._randomness

    async def _draw(self) -> RoundRandomness:
        """The seed from the shares of every member that committed to one in a request to this peer (a member
        that never reached it is in no average here); after the timeout, from the shares revealed so far: a
        member that commits and never reveals delays the round's checks, it cannot stop them."""
        try:
            await asyncio.wait_for(self.settled.wait(), self.config.round_timeout + self.config.verification.timeout)
        except TimeoutError:
            pass
        expected = set(self.commitments) | {self.me}
        # a member reveals its share once every reducer's statement is in, or after one timeout: two here
        if not await self._until(lambda: set(self.shares) >= expected, 2):
            logger.warning("Round %s: no seed share from %s within %.0f s; drawing from the others'",
                           self.group.round_id, ", ".join(sorted(expected - set(self.shares))),
                           2 * self.config.verification.timeout)
        shares = {member: self.shares[member] for member in expected if member in self.shares}
        return RoundRandomness(round_seed(self.group.round_id, shares), self.chunk_numel)

    def my_samples(self) -> Awaitable[pb.Signed]:
        if self._mine is None:
            self._mine = asyncio.ensure_future(self._build_mine())
        return self._mine

    async def _build_mine(self) -> pb.Signed:
        randomness = await self.randomness()
        others = set(range(len(self.spans))) - {self.rank}
        # each row is sealed once its last chunk is out, before the last averages are in: project them meanwhile
        await self._until(lambda: all(span in self.own_rows or span in self.rows_done for span in others))
        rows = await asyncio.to_thread(row_samples, self.signing, self.group.round_id, randomness,
                                       dict(self.own_rows), self.with_sketch)
        await self._until(lambda: self.rows_done >= others)
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
        randomness = await self.randomness()
        await self.my_samples()
        needed = {self.group.members[r] for chunk in statement.chunks if not chunk.void for r in chunk.included}
        await self._until(lambda: set(self.unparsed) >= needed)
        problems: dict[str, str] = {}
        for member, parsing in sorted(self.parsing.items()):
            parsed = await parsing
            if isinstance(parsed, str):
                problems[member] = parsed
            else:
                self.samples.setdefault(member, parsed)
        for stated in self.samples.values():
            self._compare_outputs(stated, span)
        missing = sorted(needed - set(self.samples))
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
        by_rank = {self.group.rank_of(m): s for m, s in self.samples.items()}
        return span_verdict(statement, by_rank, held, randomness, self.config, is_state_round(self.group.round_id))

    # --- disputes -----------------------------------------------------------------------------------------------

    async def judge(self, span: int, index: int, rows: dict[int, bytes] | None) -> None:
        """Decides who lied about chunk ``index`` of span ``span`` from the rows its reducer revealed (None: it
        did not answer) and accuses them (``accuse(peer, reason, evidence, proven)``)."""
        statement = self.statements[span]
        reducer = statement.reducer
        out, signature, _ = self.outputs[span][index]
        signed = output_signed(statement, index, out, signature, self.keys)
        if rows is None:
            self.accuse(reducer, f"did not reveal the rows of chunk {index} of its span when challenged", None,
                        False)
            return
        by_rank = {self.group.rank_of(m): s for m, s in self.samples.items()}
        judgment = await asyncio.to_thread(judge_chunk, statement, index, self.group, rows,
                                           out if signed else None, by_rank, self.config, self.keys)
        for member, why in judgment.members.items():
            rank = self.group.rank_of(member)
            self.accuse(member, why, false_samples(statement, index, self.samples[member], rank, rows[rank]), True)
        if judgment.reducer is not None:
            self.accuse(reducer, judgment.reducer, bad_reduction(statement, index, out, signature, rows), True)
        elif judgment.unanswered is not None:
            self.accuse(reducer, judgment.unanswered, None, False)
        elif not signed:
            self.accuse(reducer, f"sent an average of chunk {index} its own signature does not cover", None, False)
