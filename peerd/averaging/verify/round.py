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
from dataclasses import dataclass, field

import torch

from peerd.averaging.group import Group, is_state_round
from peerd.averaging.layout import chunk_bounds
from peerd.averaging.verify.checks import Inconsistent, check_chunks
from peerd.averaging.verify.disputes import judge_chunk, output_signed
from peerd.averaging.verify.keys import KeyBook, SigningKey
from peerd.averaging.verify.payloads import PayloadView, bounded, checks_averages, view
from peerd.averaging.verify.proofs import Evidence, bad_reduction, equivocation, false_samples, two_averages
from peerd.averaging.verify.randomness import RoundRandomness, commitment, new_share, round_seed
from peerd.averaging.verify.samples import MemberSamples, OwnRow, build_samples, parse_samples
from peerd.averaging.verify.sketches import look_alike
from peerd.averaging.verify.statement import Statement, parse_statement
from peerd.config import AveragingConfig
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb

__all__ = ["Accuse", "RoundVerification", "Verdict"]

logger = logging.getLogger(__name__)

_AUDIT = random.SystemRandom()


Accuse = Callable[[str, str, Evidence | None, bool], None]


@dataclass
class Verdict:
    apply: bool
    reason: str = ""
    challenge: int | None = None  # a chunk whose rows would show who lied (or an audit of one that passed)
    void: list[int] = field(default_factory=list)
    unchecked: list[int] = field(default_factory=list)  # chunks coded without a bound, applied as this peer codes


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
        self.own_rows: dict[int, OwnRow] = {}
        self.rows_done: set[int] = set()  # spans whose contribution this member finished sending (or gave up on)
        self.own_hashes: dict[int, list[bytes]] = {}
        self.own_weight = 0.0
        # span -> chunk -> (payload, the reducer's signature, blake3 of the payload)
        self.outputs: dict[int, dict[int, tuple[bytes, bytes, bytes]]] = {}
        self.samples: dict[str, MemberSamples] = {}
        self.unparsed: dict[str, pb.Signed] = {}
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
            self.statements[span] = parse_statement(signed, self.group, span, end - start, self.chunk_numel,
                                                    self.keys)
        except ProtocolViolation as e:
            self.problems[span] = e.message
            raise

    async def row_done(self, span: int) -> None:
        """This member's contribution to span ``span`` is sent and sealed (``own_rows``), or never will be."""
        await self._note(lambda: self.rows_done.add(span))

    async def samples_from(self, member: str, signed: pb.Signed) -> None:
        await self._note(lambda: self.unparsed.setdefault(member, signed))

    async def _note(self, change: Callable[[], object]) -> None:
        async with self._changed:
            change()
            self._changed.notify_all()

    async def _until(self, ready: Callable[[], bool]) -> bool:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(ready), self.config.verification.timeout)
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
        if not await self._until(lambda: set(self.shares) >= expected):
            logger.warning("Round %s: no seed share from %s within %.0f s; drawing from the others'",
                           self.group.round_id, ", ".join(sorted(expected - set(self.shares))),
                           self.config.verification.timeout)
        shares = {member: self.shares[member] for member in expected if member in self.shares}
        return RoundRandomness(round_seed(self.group.round_id, shares), self.chunk_numel)

    def my_samples(self) -> Awaitable[pb.Signed]:
        if self._mine is None:
            self._mine = asyncio.ensure_future(self._build_mine())
        return self._mine

    async def _build_mine(self) -> pb.Signed:
        randomness = await self.randomness()
        others = set(range(len(self.spans))) - {self.rank}
        await self._until(lambda: self.rows_done >= others)
        signed = await asyncio.to_thread(build_samples, self.signing, self.group.round_id, randomness,
                                         dict(self.own_rows), self.with_sketch, self.outputs)
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
        for member in sorted(set(self.unparsed) - set(self.samples)):
            try:
                self.samples[member] = parse_samples(self.unparsed[member], member, self.group.round_id,
                                                     randomness.seed, self.layout, self.config.codec.block_size,
                                                     self.keys)
            except ProtocolViolation as e:
                problems[member] = e.message
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
        start, _ = self.spans[span]
        by_rank = {self.group.rank_of(m): s for m, s in self.samples.items()}
        void: list[int] = []
        unchecked: list[int] = []
        ready: list[int] = []  # the chunks checked against the samples, all at once (checks.check_chunks)
        outs: list[torch.Tensor] = []
        payloads: list[PayloadView] = []
        required: list[int] = []
        problem: Verdict | None = None  # the first chunk that fails before its samples are looked at
        own = self.own_rows.get(span)
        for index, chunk in enumerate(statement.chunks):
            if chunk.void:
                void.append(index)
                continue
            output = self.outputs.get(span, {}).get(index)
            if output is None:
                problem = Verdict(False, f"no average of chunk {index}")
                break
            if self.rank in chunk.included:
                row = statement.rows[self.rank]
                if row.hashes != self.own_hashes.get(span, [])[: len(row.hashes)] or row.weight != self.own_weight:
                    problem = Verdict(False, "its statement misstates this member's row", index)
                    break
            payload = view(output[0])
            if not bounded(payload):
                if checks_averages(self.config.codec, self.config.verification.check_narrow_codes):
                    problem = Verdict(False, f"its average of chunk {index} is coded {payload.scheme.name}, which "
                                             f"no member can check; this peer applies only averages it checks")
                    break
                unchecked.append(index)  # this peer codes that way itself: it takes the averages on trust
                continue
            missing = [r for r in chunk.included if statement.span not in by_rank[r].spans]
            if missing:
                problem = Verdict(False, f"no samples of span {span} from ranks {missing}")
                break
            a, b = self.layout[span][index]
            ready.append(index)
            outs.append(self.result[start + a : start + b])
            payloads.append(payload)
            required.append(own.counts[index] if own is not None and self.rank in chunk.included and
                            index < len(own.counts) else 0)
        try:  # a chunk before the first problem that fails its checks comes first
            check_chunks(statement, ready, by_rank, outs, payloads, randomness, self.config, required)
        except Inconsistent as e:
            return Verdict(False, str(e), e.chunk)
        if problem is not None:
            return problem
        agreeing = is_state_round(self.group.round_id)  # identical rows are members there: no copies to hide
        audit = None if agreeing else next((i for i in ready if look_alike(statement, i, by_rank)), None)
        return Verdict(True, challenge=audit, void=void, unchecked=unchecked)

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
