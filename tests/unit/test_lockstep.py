"""Lockstep mode (training.samples_per_step): its config checks and the decisions a waiting peer makes."""

from __future__ import annotations

import pytest

from peerd.config import TrainingConfig, load_config
from peerd.errors import ConfigError
from peerd.training.lockstep import canonical_order, micro_batches_per_step, ready_at, waiting_for
from peerd.training.progress import ProgressRecord, SwarmProgress

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
