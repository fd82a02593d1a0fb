"""A member's verdict on one reducer's span: whether to apply its averages, from the statement, every included
member's samples and what this member itself holds of the span (the averages it received, its own row).

A chunk marked void is applied by nobody; a chunk coded without a bound is applied unchecked only by a peer that
codes that way itself. Every other chunk must have an average, a statement true to this member's own row and
every included member's samples, and then passes the checks (checks.py), all the span's chunks at once. The
first chunk that fails decides the verdict, and is the one challenged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from peerd.averaging.verify.checks import Inconsistent, check_chunks
from peerd.averaging.verify.payloads import PayloadView, bounded, checks_averages, view
from peerd.averaging.verify.randomness import RoundRandomness
from peerd.averaging.verify.samples import MemberSamples, OwnRow
from peerd.averaging.verify.sketches import look_alike
from peerd.averaging.verify.statement import Statement
from peerd.config import AveragingConfig

__all__ = ["Held", "Verdict", "span_verdict"]


@dataclass
class Verdict:
    apply: bool
    reason: str = ""
    challenge: int | None = None  # a chunk whose rows would show who lied (or an audit of one that passed)
    void: list[int] = field(default_factory=list)
    unchecked: list[int] = field(default_factory=list)  # chunks coded without a bound, applied as this peer codes


@dataclass(frozen=True)
class Held:
    """What this member holds of one span."""

    rank: int
    outputs: dict[int, tuple[bytes, bytes, bytes]]  # chunk -> (payload, the reducer's signature, blake3 of it)
    norms: dict[int, torch.Tensor]  # chunk -> the average's block norms, taken as it came (while in cache)
    averages: torch.Tensor  # the span's decoded averages
    chunks: list[tuple[int, int]]  # the span's chunk bounds
    own: OwnRow | None  # this member's row in the span, if it sent one
    own_hashes: list[bytes]  # the chunk hashes it sealed
    own_weight: float


def span_verdict(statement: Statement, samples: dict[int, MemberSamples], held: Held, randomness: RoundRandomness,
                 config: AveragingConfig, agreeing: bool) -> Verdict:
    """``samples``: by rank; ``agreeing``: a state round, whose identical rows are members, not copies."""
    void: list[int] = []
    unchecked: list[int] = []
    ready: list[int] = []  # the chunks checked against the samples
    outs: list[torch.Tensor] = []
    payloads: list[PayloadView] = []
    required: list[int] = []
    norms: list[torch.Tensor | None] = []
    problem: Verdict | None = None  # the first chunk that fails before its samples are looked at
    for index, chunk in enumerate(statement.chunks):
        if chunk.void:
            void.append(index)
            continue
        output = held.outputs.get(index)
        if output is None:
            problem = Verdict(False, f"no average of chunk {index}")
            break
        mine = held.rank in chunk.included
        if mine:
            row = statement.rows[held.rank]
            if row.hashes != held.own_hashes[: len(row.hashes)] or row.weight != held.own_weight:
                problem = Verdict(False, "its statement misstates this member's row", index)
                break
        payload = view(output[0])
        if not bounded(payload):
            if checks_averages(config.codec, config.verification.check_narrow_codes):
                problem = Verdict(False, f"its average of chunk {index} is coded {payload.scheme.name}, which no "
                                         f"member can check; this peer applies only averages it checks")
                break
            unchecked.append(index)  # this peer codes that way itself: it takes the averages on trust
            continue
        missing = [r for r in chunk.included if statement.span not in samples[r].spans]
        if missing:
            problem = Verdict(False, f"no samples of span {statement.span} from ranks {missing}")
            break
        a, b = held.chunks[index]
        ready.append(index)
        outs.append(held.averages[a:b])
        payloads.append(payload)
        norms.append(held.norms.get(index))
        own = held.own
        required.append(own.counts[index] if own is not None and mine and index < len(own.counts) else 0)
    try:  # a chunk before the first problem that fails its checks comes first
        check_chunks(statement, ready, samples, outs, payloads, randomness, config, required, norms)
    except Inconsistent as e:
        return Verdict(False, str(e), e.chunk)
    if problem is not None:
        return problem
    audit = None if agreeing else next((i for i in ready if look_alike(statement, i, samples)), None)
    return Verdict(True, challenge=audit, void=void, unchecked=unchecked)
