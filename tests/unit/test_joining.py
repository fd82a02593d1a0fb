"""When a trainer loads a state and takes up another step (peerd/training/joining.py), with a stand-in trainer
and donors over in-process socket pairs: one member far ahead moves nobody; a joiner behind a quorum loads the
state the quorum vouches for (catching the liar that offers noise under its digests) and takes up the group's
step; a joiner of a fresh swarm needs no download; a failed load is not retried at once."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from peerd.config import TrainingConfig
from peerd.training import joining as joining_module
from peerd.training.distrust import Distrust
from peerd.training.evidence import Evidence
from peerd.training.joining import Joining
from peerd.training.progress import ProgressRecord, StateClaim, SwarmProgress
from peerd.training.report import TrainingReport
from peerd.training.state import TrainingState
from peerd.training.transfer.digest import pieces, take_snapshot
from peerd.training.transfer.server import StateServer
from tests.unit.state_streams import LocalNet

pytestmark = pytest.mark.timeout(30)

FP = "fp-test"
ME, A, B, LIAR = (f"12D3KooW{letter * 44}" for letter in "MABL")
NUMEL = 5000


def flat(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


SEED, TRAINED = take_snapshot(0, flat(0)), take_snapshot(30, flat(30))


class Mode:
    ahead_ok = 0

    def __init__(self) -> None:
        self.loaded: torch.Tensor | None = None

    def averaged_numel(self) -> int:
        return NUMEL

    def load_agreed(self, flat: torch.Tensor) -> None:
        self.loaded = flat.clone()

    async def settled(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


class Local:
    def drop_gradients(self) -> None:
        pass

    def forget_residuals(self) -> None:
        pass


@dataclass
class Progress:
    view: SwarmProgress = field(default_factory=SwarmProgress)
    claim: StateClaim | None = None

    async def refresh(self) -> SwarmProgress:
        return self.view


class Trainer:
    def __init__(self, step: int) -> None:
        self.config = TrainingConfig()
        self.local = Local()
        self.mode = Mode()
        self.report = TrainingReport(fingerprint=FP, parameters=NUMEL)
        self.progress = Progress()
        self.distrust = Distrust()
        self.evidence = Evidence(ME, 1, 1.0, self.distrust)
        self.step, self.samples = step, 96
        self.step_lock = asyncio.Lock()

    async def publish(self, if_changed: bool = False) -> None:
        pass


def record(peer: str, step: int, state: Any) -> ProgressRecord:
    claim = StateClaim(step=state.step, digest=state.root.hex()) if state is not None else None
    return ProgressRecord(peer_id=peer, fingerprint="f" * 16, step=step, samples=0, samples_per_second=1.0, time=1.0,
                          state=claim)


async def joining_for(trainer: Trainer, net: LocalNet, *records: ProgressRecord) -> Joining:
    trainer.progress.view = SwarmProgress(peers={r.peer_id: r for r in records})
    joining = Joining(trainer, net.guard(ME), FP, trainer.distrust)  # type: ignore[arg-type]
    joining.downloader.retry_delay = 0.0
    await joining.agree(trainer.step, flat(0) if trainer.step == 0 else flat(trainer.step))
    return joining


async def donors(net: LocalNet, **states: TrainingState) -> dict[str, StateServer]:
    servers = {}
    for peer, state in states.items():

        async def provider(state: TrainingState = state) -> TrainingState:
            return state

        servers[peer] = StateServer(net.guard(peer), FP, provider)
        await servers[peer].start()
    return servers


NOISE = TrainingState(30, pieces(flat(666)), TRAINED.digests)  # the honest manifest over noise


def test_one_member_far_ahead_reloads_nobody() -> None:
    async def body() -> None:
        net = LocalNet()
        liar_state = take_snapshot(30_040, flat(666))
        servers = await donors(net, **{LIAR: liar_state.state()})
        trainer = Trainer(40)
        joining = await joining_for(trainer, net, record(A, 40, TRAINED), record(B, 40, TRAINED),
                                    record(LIAR, 30_040, liar_state))
        assert not await joining.catch_up()
        assert trainer.step == 40 and trainer.mode.loaded is None and servers[LIAR].served == 0
        assert joining.status()["unbelieved"] == {LIAR: 30_040}
        await net.close()

    asyncio.run(body())


def test_a_joiner_loads_the_vouched_state_catches_the_liar_and_takes_up_the_groups_step() -> None:
    async def body() -> None:
        net = LocalNet()
        await donors(net, **{LIAR: NOISE, A: TRAINED.state(), B: TRAINED.state()})
        trainer = Trainer(0)
        # the liar claims the honest state and to be a step ahead: it is the first donor asked
        joining = await joining_for(trainer, net, record(A, 35, TRAINED), record(B, 36, TRAINED),
                                    record(LIAR, 37, TRAINED))
        assert await joining.catch_up()
        assert trainer.mode.loaded is not None and torch.equal(trainer.mode.loaded, flat(30))
        assert trainer.step == 35 and trainer.samples == 0  # the group's step (a quorum is at 35 or later)
        assert trainer.report.state_syncs == 1 and joining.steps_adopted == 1
        assert trainer.progress.claim == StateClaim(step=30, digest=TRAINED.root.hex())  # it serves them now
        assert list(trainer.distrust.status()) == [LIAR]
        assert joining.downloader.status()["bytes_from"][LIAR] > 0
        await net.close()

    asyncio.run(body())


def test_a_joiner_of_a_fresh_swarm_holds_the_seeds_state_already() -> None:
    async def body() -> None:
        net = LocalNet()
        servers = await donors(net, **{A: SEED.state(), B: SEED.state()})
        trainer = Trainer(0)
        joining = await joining_for(trainer, net, record(A, 5, SEED), record(B, 6, SEED))
        assert await joining.catch_up()
        assert trainer.step == 5 and trainer.mode.loaded is None
        assert sum(s.served for s in servers.values()) == 0
        await net.close()

    asyncio.run(body())


def test_a_failed_load_takes_up_no_step_and_is_not_retried_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    async def body() -> None:
        net = LocalNet()  # nobody serves
        trainer = Trainer(0)
        joining = await joining_for(trainer, net, record(A, 35, TRAINED), record(B, 36, TRAINED))
        joining.downloader.rounds = 1
        assert not await joining.catch_up()
        assert trainer.step == 0 and trainer.report.state_sync_failures == 1
        assert not await joining.catch_up()  # within RETRY seconds: not tried again
        assert trainer.report.state_sync_failures == 1
        monkeypatch.setattr(joining_module, "RETRY", 0.0)
        joining._retry_at = 0.0
        assert not await joining.catch_up()
        assert trainer.report.state_sync_failures == 2
        assert trainer.distrust.status() == {}  # nobody lied
        await net.close()

    asyncio.run(body())


def test_a_joiner_takes_up_no_step_before_a_quorum_names_one_state() -> None:
    async def body() -> None:
        net = LocalNet()
        await donors(net, **{A: TRAINED.state(), B: TRAINED.state()})
        trainer = Trainer(0)
        newer = take_snapshot(31, flat(31))
        # A's round has landed, B's not yet: they name different states for a moment
        joining = await joining_for(trainer, net, record(A, 35, newer), record(B, 36, TRAINED))
        assert not await joining.catch_up() and joining.undecided
        assert trainer.step == 0 and trainer.mode.loaded is None  # not step 35 with the seed's state
        trainer.progress.view.peers[A] = record(A, 35, TRAINED)
        assert await joining.catch_up() and not joining.undecided
        assert trainer.mode.loaded is not None and torch.equal(trainer.mode.loaded, flat(30))
        assert trainer.step == 35
        await net.close()

    asyncio.run(body())
