"""One averaging round, written once for every kind of round the trainer runs: a group forms under a key and
all-reduces a flat tensor, or, when no group forms, this peer goes on alone with its own tensor.

Sync mode's gradient steps, diloco's outer rounds and the lossless state averaging of both modes all go
through :class:`RoundRunner`. A round that fails (no other peer at the step, matchmaking timed out, a member
vanished mid-round) is an ordinary outcome, counted in the report; it never stops training.
"""

from __future__ import annotations

import logging

import torch

from peerd.averaging.allreduce import AllReducer
from peerd.averaging.group import Group
from peerd.averaging.matchmaking import Matchmaker
from peerd.config import CodecConfig
from peerd.errors import GroupFailed, PeerdError
from peerd.training import lockstep
from peerd.training.progress import ProgressTracker
from peerd.training.report import TrainingReport

__all__ = ["RoundRunner"]

logger = logging.getLogger(__name__)


class RoundRunner:
    def __init__(self, matchmaker: Matchmaker, reducer: AllReducer, report: TrainingReport,
                 progress: ProgressTracker, codec: CodecConfig, in_shard_order: bool) -> None:
        """``in_shard_order``: lockstep mode, whose groups are ordered by data shard (the same ranks in every run).
        ``codec``: the all-reduce's codec, of which state averaging uses a lossless copy."""
        self.matchmaker = matchmaker
        self.reducer = reducer
        self.report = report
        reducer.audits.on_bytes = lambda sent, received: report.record_traffic("checks", sent, received)
        self.progress = progress
        self.in_shard_order = in_shard_order
        self.lossless = codec.model_copy(update={"lossless": True, "error_feedback": False})

    async def average(self, key: str, tensor: torch.Tensor, weight: float, expected: int, *,
                      residual: torch.Tensor | None, average_residual: torch.Tensor | None, out: torch.Tensor,
                      window: float | None = None, what: str = "Step") -> torch.Tensor:
        """``tensor`` averaged (weighted by ``weight``, the samples behind it) with the group of the round ``key``
        into ``out``; ``tensor`` itself when no group formed. ``expected``: trainers at this step, this one
        included; under 2 no round is tried. ``what`` names the round in logs ("Step 12", "Phase 3")."""
        try:
            if expected < 2:
                raise GroupFailed("no other peer is at this step")
            group = await self.ordered(await self.matchmaker.form_group(key, expected, window))
            averaged, round_report = await self.reducer.all_reduce(
                group, tensor, weight, residual, average_residual=average_residual, out=out)
            self.report.record_round(round_report, samples=int(weight))
            return averaged
        except PeerdError as e:  # no group, or the DHT did not answer in time: this step goes alone
            logger.log(logging.DEBUG if expected < 2 else logging.INFO, "%s without averaging: %s", what, e)
            self.report.record_solo(str(e), expected - 1)
            return tensor

    async def state_group(self, key: str, expected: int) -> Group | None:
        """The group of the state-averaging round ``key``, or None (logged) if none formed. Formed before the
        caller takes the step lock: matchmaking may wait a window, and inner steps go on meanwhile."""
        if expected < 2:
            return None
        try:
            return await self.ordered(await self.matchmaker.form_group(key, expected))
        except PeerdError as e:
            logger.info("State averaging %s skipped: %s", key, e)
            return None

    async def average_losslessly(self, group: Group, flat: torch.Tensor) -> torch.Tensor | None:
        """The plain mean of ``flat`` over ``group``, sent without loss (state averaging: parameters and
        optimizer slots, where 8-bit noise would land in the weights); None (logged) if the round failed."""
        try:
            # the members' parameters are bit-identical unless someone lies: an honest majority's row must win,
            # which the round's kind (a state round: averaging.group.is_state_round) tells every member
            averaged, state_round = await self.reducer.all_reduce(group, flat, 1.0, codec_config=self.lossless)
        except PeerdError as e:
            logger.info("State averaging in round %s failed: %s", group.round_id, e)
            return None
        self.report.record_traffic("state", state_round.bytes_sent, state_round.bytes_received)
        self.report.record_traffic("checks", state_round.check_bytes_sent, state_round.check_bytes_received)
        return averaged

    async def ordered(self, group: Group) -> Group:
        """In lockstep mode, the group's members in shard order; else as is."""
        if not self.in_shard_order:
            return group
        records = self.progress.view.peers
        if not set(group.members) <= set(records):
            # a member registered after our last read; its record was stored before its registration
            records = (await self.progress.refresh()).peers
        return Group(group.round_id, lockstep.canonical_order(group.members, records))
