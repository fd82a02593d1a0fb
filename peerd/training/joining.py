"""Joining the swarm and keeping up with it, on evidence rather than on any one member's word.

Every trainer keeps a :class:`~peerd.training.transfer.digest.Snapshot` of the state it last agreed on with a
group: its initial state (the seed makes it the same on every fresh peer), then the result of each lossless
state averaging and (diloco) each outer round averaged in a group; while it sees no other member, its own
state at those points. It serves that snapshot to joiners and names its digest in its progress record.

A trainer counts as behind only when a quorum of the other members is ahead of it
(:meth:`~peerd.training.evidence.Evidence.believed_step`): a joiner, or a member that fell behind its group.
Then it loads the newest state a quorum vouches for, if that is newer than its own, checking every piece as it
arrives; and if the group is still ahead (sync mode snapshots only at state averaging), it takes up the
group's step with the state it has, which the next state averaging brings in line. One member's claim to be
ahead reloads nobody, and its state is never loaded unless a quorum holds the same bits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import torch

from peerd import threads
from peerd.config import TrainingConfig
from peerd.errors import StateError
from peerd.training.distrust import Distrust
from peerd.training.evidence import Evidence, Vouched
from peerd.training.local import LocalModel
from peerd.training.modes import Mode
from peerd.training.progress import ProgressTracker, StateClaim
from peerd.training.report import TrainingReport
from peerd.training.state import TrainingState
from peerd.training.transfer.digest import Snapshot, piece_template, pieces, root_digest, take_snapshot
from peerd.training.transfer.download import StateDownloader
from peerd.training.transfer.manifest import Manifest
from peerd.wire.guard import StreamGuard

__all__ = ["Joining"]

logger = logging.getLogger(__name__)

RETRY = 10.0  # seconds before a trainer that could not load a vouched state tries again


class Trainer(Protocol):
    """The trainer, as joining sees it."""

    config: TrainingConfig
    local: LocalModel
    mode: Mode
    report: TrainingReport
    progress: ProgressTracker
    evidence: Evidence
    step: int
    samples: int
    step_lock: asyncio.Lock

    async def publish(self, if_changed: bool = False) -> None: ...


class Joining:
    def __init__(self, trainer: Trainer, guard: StreamGuard, fingerprint: str, distrust: Distrust) -> None:
        self.trainer = trainer
        config = trainer.config
        self.numel = trainer.mode.averaged_numel()
        self.downloader = StateDownloader(guard, fingerprint, piece_template(self.numel), config.max_state_bytes,
                                          stall_timeout=config.state_transfer.stall_timeout, distrust=distrust)
        self.distrust = distrust
        self.snapshot: Snapshot | None = None
        self.steps_adopted = 0
        self._snapshot_lock = asyncio.Lock()
        self._retry_at = 0.0
        self._flat: torch.Tensor | None = None  # what the current download writes into
        self.undecided = False  # a quorum is ahead, but no state a quorum holds is in view (yet)

    # --- the state this trainer serves -------------------------------------------------------------------

    async def agree(self, step: int, flat: torch.Tensor) -> None:
        """``flat`` (owned from now on: pass a copy) is the state this trainer agreed on with a group at
        ``step``: hashed, kept, served and named in the progress record."""
        async with self._snapshot_lock:  # a later agreement never loses to an earlier one still hashing
            self._keep(await asyncio.to_thread(take_snapshot, step, flat))

    def _keep(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.trainer.progress.claim = StateClaim(step=snapshot.step, digest=snapshot.root.hex())

    async def serve(self) -> TrainingState | None:
        """The snapshot, once a round in flight (diloco) has landed and replaced it with a newer one."""
        if not await self.trainer.mode.settled():
            return None
        return self.snapshot.state() if self.snapshot is not None else None

    # --- keeping up ------------------------------------------------------------------------------------

    async def catch_up(self) -> bool:
        """If a quorum of members is ahead: loads the newest vouched state if it is newer than ours and, if the
        group is still ahead, takes up its step with the state it has (only once nothing newer is vouched for:
        a joiner never takes up a step with a state older than the group's). True if its step or state changed."""
        t = self.trainer
        target = t.evidence.believed_step(t.progress.view)
        if target is None or target <= t.step + t.mode.ahead_ok:
            return False
        vouched = t.evidence.vouched(t.progress.view)
        self.undecided = vouched is None
        if vouched is None:  # no state a quorum holds (their records may be between two rounds): not yet
            return False
        mine = self.snapshot.root.hex() if self.snapshot is not None else None
        if vouched.step >= t.step and (vouched.step, vouched.digest) != (t.step, mine):
            if time.monotonic() < self._retry_at:
                return False
            if not await self._load(vouched):
                self._retry_at = time.monotonic() + RETRY
                return False
            target = t.evidence.believed_step(t.progress.view) or target
        if target > t.step + t.mode.ahead_ok:
            await self._adopt(target)
        return True

    async def join(self) -> None:
        """Catches up before training (a joiner): while a quorum is ahead but its records do not name one state
        yet (a round is landing), reads them again, for at most ``training.progress_ttl`` seconds."""
        t = self.trainer
        deadline = time.monotonic() + t.config.progress_ttl
        while not await self.catch_up() and self.undecided and time.monotonic() < deadline:
            await asyncio.sleep(t.config.progress_period)
            await t.progress.refresh()

    async def _load(self, vouched: Vouched) -> bool:
        t = self.trainer
        t.report.state = "syncing"

        async def refresh() -> list[str]:
            fresh = t.evidence.vouched(await t.progress.refresh())
            return list(fresh.members) if fresh is not None else []

        async def accept(manifest: Manifest, donor: str) -> str | None:
            assert manifest.root is not None  # the downloader asks only of manifests with digests
            doubt = t.evidence.doubt(t.progress.view, manifest.step, manifest.root.hex(), donor)
            if doubt is not None:  # our view may predate the donor's newer agreement
                doubt = t.evidence.doubt(await t.progress.refresh(), manifest.step, manifest.root.hex(), donor)
            return doubt

        try:
            state = await self.downloader.download(vouched.members, refresh, min_step=vouched.step, accept=accept,
                                                   into=self._pieces)
        except StateError as e:
            logger.warning("Could not load a state the swarm vouches for; training on from step %d: %s", t.step, e)
            t.report.state_sync_failures += 1
            return False
        assert state.digests is not None and self._flat is not None
        flat, self._flat = self._flat, None
        await t.mode.settled()  # a round in flight belongs to a phase the loaded state already contains
        t.mode.cancel()
        async with t.step_lock:
            await threads.run(t.mode.load_agreed, flat)
            t.step, t.samples, t.report.inner_steps = state.step, 0, 0
            t.local.drop_gradients()
            t.local.forget_residuals()
        async with self._snapshot_lock:  # we hold exactly these bits now: serve them and vouch for them
            self._keep(Snapshot(state.step, flat, state.digests, _root(state)))
        t.report.record_traffic("state_sync", 0, state.nbytes)
        t.report.step = t.step
        t.report.state_syncs += 1
        logger.info("Loaded training state at step %d from %s (vouched for by %d members)", state.step,
                    ", ".join(self.downloader.bytes_from), len(vouched.members))
        await t.publish()
        return True

    def _pieces(self) -> dict[str, torch.Tensor]:
        self._flat = torch.empty(self.numel, dtype=torch.float32)
        return pieces(self._flat)

    async def _adopt(self, target: int) -> None:
        """Takes up the group's step with the state this trainer has (what it accumulated is dropped); the next
        state averaging brings the state in line."""
        t = self.trainer
        async with t.step_lock:
            before, t.step, t.samples, t.report.inner_steps = t.step, target, 0, 0
            t.local.drop_gradients()
        t.report.step = t.step
        self.steps_adopted += 1
        logger.info("Joining the swarm at step %d (a quorum of members is there; this peer was at %d)", target,
                    before)
        await t.publish()

    def status(self) -> dict[str, Any]:
        """What this trainer believes of the others' claims, for the status endpoint."""
        t = self.trainer
        view = t.progress.view
        vouched = t.evidence.vouched(view)
        own = self.snapshot
        return {
            "believed_step": t.evidence.believed_step(view),
            "vouched": {"step": vouched.step, "digest": vouched.digest, "members": list(vouched.members)}
            if vouched is not None else None,
            "serving": {"step": own.step, "digest": own.root.hex()} if own is not None else None,
            "steps_adopted": self.steps_adopted,
            "unbelieved": t.evidence.unbelieved(view, t.step),
            "excluded": self.distrust.status(),
        }


def _root(state: TrainingState) -> bytes:
    assert state.digests is not None
    layout = {name: (tuple(v.shape), v.dtype) for name, v in state.tensors.items()}
    return root_digest(state.step, layout, state.digests)
