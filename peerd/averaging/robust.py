"""A reducer's side of robust aggregation: every member's decoded chunk kept until the chunk is combined, the
members' claimed weights, and what the rule did to whom.

Memory stays bounded: a chunk's rows (members x chunk_numel floats) exist from its first contribution until
it is combined, and a sender is read at most ``WINDOW`` chunks ahead of the oldest chunk still open (the
reducer waits before reading further), so a round holds at most ``WINDOW + 1`` such buffers, reused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from peerd.averaging.aggregation import ROBUST_MIN_MEMBERS, Combined, combine
from peerd.averaging.group import Clipping, Group
from peerd.config import AveragingConfig

logger = logging.getLogger(__name__)

WINDOW = 4
KEPT_EPSILON = 1e-6  # a kept fraction above 1 - this is rounding, not clipping
HEAVY_CLIP = 0.5  # kept less than this: logged as a warning


def rule_label(config: AveragingConfig, members: int) -> str:
    """The rule a group of ``members`` uses under ``config``, as reports name it."""
    if config.aggregation == "mean":
        return "mean"
    if members < ROBUST_MIN_MEMBERS:
        return f"norm-equalized mean ({config.aggregation} needs {ROBUST_MIN_MEMBERS}+ members)"
    return config.aggregation


@dataclass
class RobustChunks:
    group: Group
    rank: int  # the reducer's
    chunk_numel: int
    config: AveragingConfig
    agreeing: bool = False  # identical rows are members that agree, not copies (aggregation.combine)

    def __post_init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}
        self.spare: list[torch.Tensor] = []
        self.claims: dict[str, float] = {}
        self.clipped: dict[str, Clipping] = {}

    def row(self, index: int, member: str, numel: int) -> torch.Tensor:
        """Where ``member``'s decoded chunk ``index`` goes (``numel`` elements)."""
        rows = self.rows.get(index)
        if rows is None:
            n = len(self.group.members)
            rows = self.spare.pop() if self.spare else torch.empty(n, self.chunk_numel)
            self.rows[index] = rows
        return rows[self.group.rank_of(member), :numel]

    def combine(self, index: int, included: set[str], numel: int, out: torch.Tensor) -> tuple[list[str], Combined]:
        """Combines chunk ``index`` over the ``included`` members (their rows, the reducer's own included) into
        ``out``; returns those members in rank order and what the rule did."""
        rows = self.rows.pop(index)
        members = [m for m in self.group.members if m in included]
        ranks = [self.group.rank_of(m) for m in members]
        selected = rows[:, :numel] if len(ranks) == rows.shape[0] else rows[ranks, :numel]
        claims = [self.claims[m] for m in members]
        result = combine(self.config.aggregation, selected, claims, out, self.config.max_weight_ratio,
                         self.config.clip_radius, self.config.clip_iterations, self.agreeing)
        self.spare.append(rows)
        if numel:  # an empty span's chunk capped weights but combined nothing: not worth a report
            self._note(index, members, claims, result)
        return members, result

    def _note(self, index: int, members: list[str], claims: list[float], result: Combined) -> None:
        for member, claim, kept, weight in zip(members, claims, result.kept, result.weights, strict=True):
            if kept >= 1.0 - KEPT_EPSILON and weight >= claim:
                continue
            note = self.clipped.setdefault(member, Clipping(span=self.rank, claimed_weight=claim, weight=weight))
            note.chunks += 1
            note.kept = min(note.kept, kept)
            note.weight = min(note.weight, weight)

    def log(self, chunks: int) -> None:
        """One line per member whose contribution to this span was clipped or weight-capped."""
        for member, note in sorted(self.clipped.items()):
            level = logging.WARNING if note.kept < HEAVY_CLIP else logging.INFO
            logger.log(level, "Round %s: %s clipped %s's contribution to span %d in %d of %d chunks (kept %.3g "
                       "of its deviation at least; weight %g of %g claimed)", self.group.round_id,
                       rule_label(self.config, len(self.group.members)), member, self.rank, note.chunks, chunks,
                       note.kept, note.weight, note.claimed_weight)
