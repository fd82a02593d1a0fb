"""Lockstep mode (training.samples_per_step): its config checks and the decisions a waiting peer makes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from peerd.config import TaskConfig, TrainingConfig, load_config
from peerd.errors import ConfigError
from peerd.tasks import build_task
from peerd.training.diloco import DilocoMode
from peerd.training.local import LocalModel
from peerd.training.lockstep import canonical_order, micro_batches_per_step, ready_at, waiting_for
from peerd.training.progress import ProgressRecord, SwarmProgress
from peerd.training.report import TrainingReport

A, B, C = (f"12D3KooW{letter * 44}" for letter in "ABC")


def record(peer: str, step: int, samples: int, shard: int | None = None) -> ProgressRecord:
    return ProgressRecord(peer_id=peer, fingerprint="f" * 16, step=step, samples=samples, samples_per_second=1.0,
                          time=1.0, shard=shard)


def view(*records: ProgressRecord) -> SwarmProgress:
    return SwarmProgress(peers={r.peer_id: r for r in records})


def test_default_is_the_timing_driven_mode() -> None:
    assert TrainingConfig().samples_per_step is None


def test_samples_per_step_is_validated_by_the_config() -> None:
    config = load_config(overrides={"training": {"samples_per_step": 32, "lockstep_timeout": 5}})
    assert config.training.samples_per_step == 32
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"training": {"samples_per_step": 0}})
    assert info.value.field == "training.samples_per_step"


def test_lockstep_timeout_below_the_progress_period_names_the_option_to_change() -> None:
    with pytest.raises(ConfigError, match="raise training.lockstep_timeout"):
        load_config(overrides={"training": {"samples_per_step": 32, "lockstep_timeout": 0.5,
                                            "progress_period": 1.0, "progress_ttl": 5.0}})
    # without lockstep mode the timeout is unused, so it is not an error
    load_config(overrides={"training": {"lockstep_timeout": 0.5, "progress_period": 1.0, "progress_ttl": 5.0}})


def test_share_must_be_whole_micro_batches() -> None:
    assert micro_batches_per_step(48, 16) == 3
    with pytest.raises(ConfigError, match="set training.samples_per_step to 32 or 48") as info:
        micro_batches_per_step(40, 16)
    assert info.value.field == "training.samples_per_step"
    with pytest.raises(ConfigError, match="to 16$"):
        micro_batches_per_step(8, 16)


def test_waits_for_peers_short_of_their_share_and_for_those_finishing_the_previous_step() -> None:
    me = record(A, 5, 32)
    assert waiting_for(view(me, record(B, 5, 16), record(C, 5, 32)), A, 5, 32) == [B]
    assert waiting_for(view(me, record(B, 4, 32), record(C, 5, 32)), A, 5, 32) == [B]  # stale or still averaging
    assert waiting_for(view(me, record(B, 2, 0), record(C, 6, 0)), A, 5, 32) == []  # will sync / is ahead
    assert waiting_for(view(me, record(B, 5, 32), record(C, 5, 48)), A, 5, 32) == []
    assert waiting_for(view(), A, 5, 32) == []  # our own record not read back yet: we know we are ready
    assert ready_at(view(me, record(B, 5, 32), record(C, 5, 16)), A, 5, 32) == 2
    assert ready_at(view(), A, 5, 32) == 1


def test_members_are_ordered_by_shard_whatever_their_registration_order() -> None:
    records = {A: record(A, 0, 0, shard=2), B: record(B, 0, 0, shard=0), C: record(C, 0, 0, shard=1)}
    assert canonical_order((A, B, C), records) == (B, C, A)
    assert canonical_order((C, A, B), records) == (B, C, A)
    # unknown shards (an older peer, or a record we could not read) go last, by peer id
    assert canonical_order((C, A, B), {C: record(C, 0, 0, shard=1)}) == (C, A, B)
    assert canonical_order((B, A), {A: record(A, 0, 0), B: record(B, 0, 0)}) == (A, B)


def test_progress_records_without_a_shard_stay_valid() -> None:
    wire = record(A, 1, 2).model_dump()
    del wire["shard"]
    assert ProgressRecord.model_validate(wire).shard is None


def _diloco_mode(overlap: bool) -> tuple[DilocoMode, list[int]]:
    """A DilocoMode on a synthetic model whose host records the group sizes its rounds were started with."""
    config = TrainingConfig(mode="diloco", lr=0.05, state_averaging_every=0,
                            diloco={"phase_end": "lockstep", "overlap": overlap})  # type: ignore[arg-type]
    local = LocalModel(config, build_task(TaskConfig(name="synthetic", options={"dim": 8}), shard_index=0),
                       error_feedback=True)
    started: list[int] = []

    async def average(key: str, tensor: object, weight: float, expected: int, **_: object) -> object:
        started.append(expected)
        return tensor  # nobody else came: this peer's own pseudo-gradient

    async def nothing(*_: object) -> None:
        return None

    host = SimpleNamespace(
        config=config, local=local, report=TrainingReport(fingerprint="x", parameters=1), checkpointer=None,
        rounds=SimpleNamespace(average=average), prefix="run", step=0, samples=32, step_lock=asyncio.Lock(),
        publish=nothing, validate=nothing, agreed=nothing, alone=lambda: True)
    return DilocoMode(host), started


def test_with_overlap_a_lockstep_phase_ends_at_once_and_its_round_waits_for_the_others() -> None:
    """The next phase starts at once and the round, in the background, waits for the others' shares: no peer
    idles until the slowest is done. Without overlap the peer waits before its phase ends."""

    async def scenario(overlap: bool) -> list[int]:
        mode, started = _diloco_mode(overlap)
        others_done = asyncio.Event()
        phase_when_waiting: list[int] = []

        async def shares() -> int:
            phase_when_waiting.append(mode.host.step)
            if overlap:
                await others_done.wait()
            return 3

        await asyncio.wait_for(mode.end_step(shares), 10)
        assert mode.host.step == 1
        if overlap:
            assert started == []  # the round still waits for the others, the phase has ended
            others_done.set()
        await asyncio.wait_for(mode.land(), 10)
        assert started == [3]
        return phase_when_waiting

    assert asyncio.run(scenario(overlap=True)) == [1]
    assert asyncio.run(scenario(overlap=False)) == [0]
