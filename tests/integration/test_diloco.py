"""diloco mode with real processes: the LM trains, every peer ends on the same shared parameters, a killed
peer stalls nobody, a late joiner gets the outer state, and --resume restores the phase."""

from __future__ import annotations

import math
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from peerd.launcher import LocalSwarm, wait_for
from tests.helpers import REPO, all_reached, ready_peer, training

pytestmark = pytest.mark.integration

LM = REPO / "configs" / "lm.yaml"
LN_256 = math.log(256)
# A small LM and short phases: ~10 inner steps take a second or two per peer on 2 shared cores.
ARGS = ["-o", "training.mode=diloco", "-o", "training.diloco.inner_steps=10",
        "-o", ("training.task.options={d_model: 64, n_heads: 2, d_ff: 128, seq_len: 64, batch_size: 8, "
        "max_files: 60, val_files: 4, val_batches: 2}"),
        "-o", "training.wait_for_peers=3", "-o", "training.validation_every=2",
        "-o", "training.state_averaging_every=0"]


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    with LocalSwarm(LM, log_dir=tmp_path, extra_args=list(ARGS)) as local_swarm:
        yield local_swarm


@pytest.mark.timeout(300)
def test_three_peers_train_and_end_on_the_same_shared_parameters(swarm: LocalSwarm) -> None:
    phases = 6
    swarm.extra_args += ["-o", f"training.max_steps={phases}"]
    swarm.start(3)
    wait_for(lambda: all((training(p)["validation_step"] or 0) >= phases and training(p)["state"] == "idle"
                         for p in swarm.peers), 240, f"{phases} phases and their validation on every peer", 0.5)
    reports = [training(p) for p in swarm.peers]
    for report in reports:
        assert report["mode"] == "diloco" and report["phase"] == phases and report["device"] == "cpu"
        assert report["rounds_ok"] >= phases - 1, report  # the first phase may start before all peers are up
        assert report["group_sizes"].get("3", 0) >= phases - 2, report
        assert report["validation_loss"] < LN_256 - 1.0, report  # from ~5.5 (ln 256): it learned
        # reported, not judged: phases this short wait on matchmaking (bench_utilisation measures it)
        assert 0.0 < report["utilisation"] <= 1.0 and report["compute_seconds"] > 0, report
    # After the last round every local model is the shared one: bit-identical models, identical losses.
    assert len({r["validation_loss"] for r in reports}) == 1, [r["validation_loss"] for r in reports]
    assert swarm.stop() == [0, 0, 0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["mid_phase", "mid_averaging"])
def test_a_killed_peer_stalls_the_others_no_longer_than_a_round_timeout(swarm: LocalSwarm, when: str) -> None:
    swarm.extra_args += ["-o", "averaging.round_timeout=10", "-o", "averaging.join_timeout=3"]
    swarm.start(3)
    survivors, victim = swarm.peers[:2], swarm.peers[2]
    wait_for(lambda: all_reached(swarm.peers, "rounds_ok", 2), 180, "2 outer rounds on every peer", 0.5)
    if when == "mid_phase":
        wait_for(lambda: training(victim)["inner_steps"] >= 3, 30, "the victim to be mid-phase", 0.05)
    else:  # its last phase's round is in flight (matchmaking or all-reduce) while its next phase computes
        wait_for(lambda: training(victim)["outer_pending"], 60, "the victim to be in an outer round", 0.05)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    before = {p.name: training(p)["rounds_ok"] for p in survivors}
    # a phase here takes a few seconds; one round may wait for the dead peer up to the round timeout (10 s)
    wait_for(lambda: all(training(p)["rounds_ok"] >= before[p.name] + 3 for p in survivors), 90,
             "3 more outer rounds on both survivors", 0.5)
    for peer in survivors:
        report = training(peer)
        assert report["last_round"]["group_size"] == 2, report
        assert report["loss"] is not None and math.isfinite(report["loss"])
    assert [p.stop() for p in survivors] == [0, 0]


@pytest.mark.timeout(420)  # beside two other tests on 2 cores it took 197 s
def test_a_late_joiner_gets_the_outer_state_and_its_first_phase_counts(swarm: LocalSwarm) -> None:
    swarm.extra_args[swarm.extra_args.index("training.wait_for_peers=3")] = "training.wait_for_peers=2"
    # Phases of several seconds, as real ones are, rather than a fraction of one (this LM takes ~100 inner
    # steps a second per peer on a quiet 2-core machine): a joiner then mostly lands mid-phase.
    swarm.extra_args[swarm.extra_args.index("training.diloco.inner_steps=10")] = "training.diloco.inner_steps=400"
    swarm.start(2)
    wait_for(lambda: all_reached(swarm.peers, "step", 3), 180, "the first two peers to reach phase 3", 0.5)
    late = swarm.add_peer()
    report = training(late)
    assert report["state_syncs"] >= 1, report
    loaded = [line for line in late.log_path.read_text().splitlines() if "Loaded training state at step" in line]
    assert loaded, late.log_tail()
    assert int(loaded[0].split("at step ")[1].split()[0]) >= 3  # the swarm's phase, not 0
    transfer = report["state_transfer"]["download"]
    assert transfer["state"] == "done" and transfer["bytes_done"] == transfer["bytes_total"] > 0, transfer
    # It averages with the others from its first phase on, except when its download completes as they close
    # that phase's round (they expected 2 members and had them): then that sliver of a phase goes alone, once.
    wait_for(lambda: training(late)["rounds_ok"] >= 2, 120, "the joiner's first outer rounds", 0.5)
    report = training(late)
    # pytest cuts a long report short: the counts and the joiner's own log say why it went alone
    assert report["rounds_solo"] <= 1 and report["group_sizes"].get("3", 0) >= 1, (
        report["rounds_solo"], report["group_sizes"], late.log_tail(40))
    assert report["loss"] < LN_256 - 1.0, report  # it continued from the swarm's model
    assert swarm.stop() == [0, 0, 0]


@pytest.mark.timeout(240)
def test_resume_restores_the_phase_and_the_outer_state(tmp_path: Path) -> None:
    args = ["--config", str(LM), *ARGS, "-o", "training.wait_for_peers=1",
            "-o", f"training.checkpoint.directory={tmp_path / 'ck'}", "-o", "training.checkpoint.every_steps=2"]
    with ready_peer("first", [*args, "-o", "training.max_steps=4"], tmp_path) as first:
        wait_for(lambda: training(first)["state"] == "idle", 120, "4 phases alone", 0.5)
        before = training(first)
        assert first.stop() == 0
    assert (tmp_path / "ck" / "ckpt-000000004.pt").is_file()
    with ready_peer("second", [*args, "-o", "training.max_steps=6", "--resume"], tmp_path) as second:
        assert training(second)["phase"] >= 4  # not back at phase 0
        assert "Resumed from" in second.log_path.read_text()
        wait_for(lambda: training(second)["state"] == "idle", 120, "2 more phases", 0.5)
        after = training(second)
        # a fresh start would be back at phase 0; the loss after two more solo phases depends on the outer
        # momentum's extrapolation (up to lr / (1 - momentum) of a phase's change alone), so it is only bounded
        assert after["phase"] == 6 and after["validation_loss"] < LN_256 - 0.5, (before, after)
        assert second.stop() == 0
