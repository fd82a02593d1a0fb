"""A member that lies about its progress and serves a false state, for tests only:
`python -m tests.integration.state_attacker start ...` is `peerd start ...` whose progress records claim a step
far ahead of the swarm (:data:`LEAD` past the furthest honest member it sees) and which serves, instead of its
state, finite noise of the right shapes (``PEERD_ATTACK_STATE=noise``) or the same with one NaN (``nan``);
``none`` tells no lie (an idle member: what a fourth process costs the others, for comparison).

What its record says is read, at every publication, from the file ``PEERD_ATTACK_CLAIM_FILE``: ``ahead`` (the
default): the step far ahead and the noise's own digest at it, a state nobody else holds; ``mimic``: a step one
ahead of the swarm (believable) and the state the honest members vouch for (copied from their records), served
with their pieces' digests (asked of one of them) over the noise's bytes, the lie that makes a joiner ask it
first.

It takes part in no round and computes nothing (its micro-steps sleep), so the honest members train exactly as
they would without it, and it never loads anyone's state.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from peerd.cli import main
from peerd.training.joining import Joining
from peerd.training.progress import ProgressTracker, StateClaim
from peerd.training.rounds import RoundRunner
from peerd.training.state import TrainingState
from peerd.training.trainer import CollaborativeTrainer
from peerd.training.transfer.digest import pieces, take_snapshot
from peerd.training.transfer.probe import probe_state

LEAD = 30_000
KIND = os.environ.get("PEERD_ATTACK_STATE", "noise")
CLAIM_FILE = os.environ.get("PEERD_ATTACK_CLAIM_FILE")


def claim_mode() -> str:
    if CLAIM_FILE is None or not Path(CLAIM_FILE).is_file():
        return "ahead"
    return Path(CLAIM_FILE).read_text().strip() or "ahead"


def fake_flat(numel: int) -> torch.Tensor:
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(1234))
    if KIND == "nan":
        flat[numel // 2] = float("nan")
    return flat


_fakes: dict[int, Any] = {}  # claimed step -> the noise's snapshot at it (its digest is what "ahead" claims)
_joinings: list[Joining] = []


def fake_snapshot(step: int, numel: int) -> Any:
    if step not in _fakes:
        _fakes.clear()
        _fakes[step] = take_snapshot(step, fake_flat(numel))
    return _fakes[step]


def honest_claim(tracker: ProgressTracker) -> StateClaim | None:
    claims = Counter(p.state for peer, p in tracker.view.peers.items()
                     if peer != tracker.swarm.peer_id and p.state is not None)
    return claims.most_common(1)[0][0] if claims else None


_honest_publish = ProgressTracker.publish


async def _lying_publish(self: ProgressTracker, step: int, samples: int, samples_per_second: float,
                         if_changed: bool = False) -> None:
    others = [p.step for peer, p in self.view.peers.items() if peer != self.swarm.peer_id]
    claimed = max([step, *others]) + LEAD
    if claim_mode() == "mimic":  # a step ahead: believable, and the first donor a joiner asks
        claimed = max([step, *others]) + 1
        self.claim = honest_claim(self)
    elif _joinings:
        self.claim = StateClaim(step=claimed, digest=fake_snapshot(claimed, _joinings[0].numel).root.hex())
    await _honest_publish(self, claimed, samples, samples_per_second, if_changed)


async def _serve_noise(self: Joining) -> TrainingState | None:
    claim = self.trainer.progress.claim
    if claim is None:
        return None
    if claim_mode() != "mimic":
        return fake_snapshot(claim.step, self.numel).state()  # type: ignore[no-any-return]
    view = self.trainer.progress.view
    for peer, record in view.peers.items():  # the honest pieces' digests, from one who holds them
        if record.state == claim and peer != self.trainer.progress.swarm.peer_id:
            manifest = await probe_state(self.downloader.guard, peer, self.downloader.fingerprint, 1 << 40)
            if manifest.digests is not None and manifest.step == claim.step:
                return TrainingState(manifest.step, pieces(fake_flat(self.numel)), manifest.digests)
    return None


_honest_init = Joining.__init__


def _remembering_init(self: Joining, *args: Any, **kwargs: Any) -> None:
    _honest_init(self, *args, **kwargs)
    _joinings.append(self)


async def _no_catch_up(self: Joining) -> bool:
    return False


async def _idle_micro_step(self: CollaborativeTrainer) -> None:
    await asyncio.sleep(0.5)


async def _alone(self: RoundRunner, key: str, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


async def _no_group(self: RoundRunner, key: str, expected: int) -> None:
    return None


def patch() -> None:
    """Makes this process the attacker (only when run as a program: a test importing :data:`LEAD` stays honest)."""
    if KIND != "none":
        ProgressTracker.publish = _lying_publish  # type: ignore[method-assign]
        Joining.serve = _serve_noise  # type: ignore[method-assign]
    Joining.__init__ = _remembering_init  # type: ignore[method-assign]
    Joining.catch_up = _no_catch_up  # type: ignore[method-assign]
    CollaborativeTrainer._micro_step = _idle_micro_step  # type: ignore[method-assign]
    RoundRunner.average = _alone  # type: ignore[method-assign]
    RoundRunner.state_group = _no_group  # type: ignore[method-assign,assignment]


if __name__ == "__main__":
    patch()
    main()
