"""What a trainer believes of the others' progress claims (peerd/training/evidence.py), whom it excludes for
how long (peerd/training/distrust.py), and what a progress record may claim (peerd/training/progress.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from peerd.config import load_config
from peerd.errors import ConfigError
from peerd.training import distrust as distrust_module
from peerd.training.distrust import Distrust
from peerd.training.evidence import Evidence
from peerd.training.progress import ProgressRecord, StateClaim, SwarmProgress

ME, A, B, C, LIAR = (f"12D3KooW{letter * 44}" for letter in "MABCL")
D1, D2, FAKE = "1" * 64, "2" * 64, "f" * 64


def record(peer: str, step: int, samples: int = 0, state: tuple[int, str] | None = None) -> ProgressRecord:
    claim = StateClaim(step=state[0], digest=state[1]) if state is not None else None
    return ProgressRecord(peer_id=peer, fingerprint="f" * 16, step=step, samples=samples, samples_per_second=1.0,
                          time=1.0, state=claim)


def view(*records: ProgressRecord) -> SwarmProgress:
    return SwarmProgress(peers={r.peer_id: r for r in records})


def evidence(vouchers: int = 1, ratio: float | None = 1.0, distrust: Distrust | None = None) -> Evidence:
    return Evidence(ME, vouchers, ratio, distrust or Distrust(), lag_grace=10.0)


# --- steps --------------------------------------------------------------------------------------------------

def test_one_member_far_ahead_is_not_believed_a_quorum_is() -> None:
    swarm = view(record(ME, 450), record(A, 450), record(B, 451), record(LIAR, 30_450))
    assert evidence().believed_step(swarm) == 451  # the second highest of the others: B, not the liar
    assert evidence(vouchers=0).believed_step(swarm) == 30_450  # trusting one member's word
    assert evidence(vouchers=2).believed_step(swarm) == 450
    # two members that fell behind see their group ahead
    assert evidence().believed_step(view(record(ME, 3), record(A, 40), record(B, 41))) == 40


def test_with_fewer_other_members_than_a_quorum_all_of_them_must_agree() -> None:
    assert evidence().believed_step(view(record(ME, 3), record(A, 40))) == 40  # no third opinion to ask
    assert evidence(vouchers=3).believed_step(view(record(ME, 3), record(A, 40), record(B, 5))) == 5
    assert evidence().believed_step(view(record(ME, 3))) is None


def test_an_excluded_member_counts_for_nothing() -> None:
    distrust = Distrust()
    distrust.accuse(LIAR, "sent a bad piece")
    swarm = view(record(ME, 1), record(A, 1), record(LIAR, 9_999), record(B, 9_999))
    assert evidence(distrust=distrust).believed_step(swarm) == 1
    assert evidence().believed_step(swarm) == 9_999  # without the exclusion, two members claim it


# --- vouched states --------------------------------------------------------------------------------------

def test_the_newest_state_a_quorum_holds_is_chosen_with_the_furthest_ahead_first() -> None:
    swarm = view(record(ME, 0, state=(0, D1)), record(A, 31, state=(30, D2)), record(B, 32, state=(30, D2)),
                 record(C, 31, state=(20, D1)), record(LIAR, 30_031, state=(30_031, FAKE)))
    vouched = evidence().vouched(swarm)
    assert vouched is not None and (vouched.step, vouched.digest, vouched.members) == (30, D2, (B, A))
    # the liar's own state, far ahead, is held by nobody else: believed only with vouchers=0
    trusting = evidence(vouchers=0).vouched(swarm)
    assert trusting is not None and (trusting.step, trusting.digest) == (30_031, FAKE)
    assert evidence(vouchers=2).vouched(swarm) is None  # nothing is held by 3 members


def test_a_liar_naming_the_honest_state_is_a_donor_but_never_its_own_voucher() -> None:
    swarm = view(record(ME, 0), record(A, 31, state=(30, D2)), record(LIAR, 30_031, state=(30, D2)))
    vouched = evidence().vouched(swarm)
    assert vouched is not None and vouched.members == (A, LIAR)  # the one far ahead is asked last
    near = view(record(ME, 0), record(A, 31, state=(30, D2)), record(B, 31, state=(30, D2)),
                record(LIAR, 32, state=(30, D2)))
    vouched = evidence().vouched(near)
    assert vouched is not None and vouched.members == (LIAR, A, B)  # a step ahead is believable: asked first
    assert evidence().doubt(swarm, 30, D2, LIAR) is None  # A vouches for what the liar offers
    assert evidence().doubt(swarm, 30, D2, A) is None  # and the liar's claim is no less true for A's
    doubt = evidence().doubt(swarm, 30_031, FAKE, LIAR)
    assert doubt is not None and "0 other members vouch for its digest ffffffffffffffff..., 1 needed" in doubt
    alone = view(record(ME, 0), record(LIAR, 30_031, state=(30_031, FAKE)))
    assert evidence().doubt(alone, 30_031, FAKE, LIAR) is None  # one other member: nobody to ask but it


def test_an_excluded_donor_is_refused_and_vouches_for_nothing() -> None:
    distrust = Distrust()
    distrust.accuse(LIAR, "sent a bad piece")
    swarm = view(record(ME, 0), record(A, 31, state=(30, D2)), record(LIAR, 30_031, state=(30, D2)))
    assert evidence(distrust=distrust).doubt(swarm, 30, D2, LIAR) == f"{LIAR} is excluded"
    vouched = evidence(distrust=distrust).vouched(swarm)
    assert vouched is not None and vouched.members == (A,)


# --- samples and rounds ----------------------------------------------------------------------------------

def test_claimed_samples_count_at_most_as_the_median_claim_as_in_the_aggregation() -> None:
    swarm = view(record(ME, 7), record(A, 7, 32), record(B, 7, 64), record(LIAR, 7, 10**9), record(C, 6, 999))
    # claims at step 7: own 32, A 32, B 64, liar 1e9; lower median 32
    assert evidence().counted_samples(swarm, 7, 32) == (32 + 32 + 32 + 32, 3)
    assert evidence(ratio=2.0).counted_samples(swarm, 7, 32) == (32 + 32 + 64 + 64, 3)
    assert evidence(ratio=None).counted_samples(swarm, 7, 32) == (32 + 32 + 64 + 10**9, 3)  # mean: trusted
    assert evidence().counted_samples(view(record(ME, 7)), 7, 32) == (32, 0)


def test_members_that_moved_on_count_with_what_they_had_when_they_left() -> None:
    before = record(A, 3, 600)
    swarm = SwarmProgress(peers={r.peer_id: r for r in (record(ME, 3), record(A, 4, 0), record(B, 3, 500))},
                          previous={A: before})
    assert evidence(ratio=None).counted_samples(swarm, 3, 400) == (400 + 500, 1)
    assert evidence(ratio=None).counted_samples(swarm, 3, 400, moved_on=True) == (400 + 500 + 600, 2)


def test_rounds_expect_members_near_this_step_and_not_a_liar_far_off(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("peerd.training.evidence.time.monotonic", lambda: clock[0])
    judge = evidence()
    swarm = view(record(ME, 10), record(A, 10), record(B, 9), record(C, 11), record(LIAR, 30_010))
    assert judge.peers_near(swarm, 10) == 4
    # B falls behind: it still counts while it was near lately (it will catch up), not after lag_grace
    behind = view(record(ME, 14), record(A, 14), record(B, 9), record(LIAR, 3))
    assert judge.peers_near(behind, 14) == 3
    clock[0] += 11
    assert judge.peers_near(behind, 14) == 2
    # alone at its step with others in view: still a round (a matchmaking window), not an instant solo step
    assert judge.peers_near(view(record(ME, 50), record(A, 40), record(B, 40)), 50) == 2
    assert judge.peers_near(view(record(ME, 50)), 50) == 1


def test_a_member_banned_from_this_peers_rounds_is_neither_expected_in_them_nor_believed() -> None:
    # a reducer proven to lie stays at the step, registering; counted, every round's leader waited out its window
    banned = {LIAR}
    judge = Evidence(ME, 1, 1.0, Distrust(), lag_grace=10.0, banned=banned.__contains__)
    swarm = view(record(ME, 10), record(A, 10), record(B, 10), record(LIAR, 10))
    assert judge.peers_near(swarm, 10) == 3
    assert evidence().peers_near(swarm, 10) == 4
    ahead = view(record(ME, 1), record(A, 1), record(LIAR, 9_999), record(B, 9_999))
    assert judge.believed_step(ahead) == 1
    assert set(judge.counted(swarm).peers) == {ME, A, B}  # lockstep waits for no banned member's share
    banned.clear()  # the ban expired: it counts again
    assert judge.peers_near(swarm, 10) == 4


def test_claims_beyond_a_step_ahead_of_what_is_believed_are_listed() -> None:
    swarm = view(record(ME, 10), record(A, 10), record(B, 11), record(LIAR, 30_010))
    assert evidence().unbelieved(swarm, 10) == {LIAR: 30_010}


# --- exclusions ----------------------------------------------------------------------------------------

def test_exclusions_double_with_each_accusation_expire_and_are_forgotten() -> None:
    clock = [0.0]
    distrust = Distrust(clock=lambda: clock[0])
    assert distrust.accuse(LIAR, "first") == distrust_module.FIRST
    assert distrust.excluded(LIAR) and not distrust.excluded(A)
    clock[0] += distrust_module.FIRST + 1
    assert not distrust.excluded(LIAR) and distrust.status() == {}
    assert distrust.accuse(LIAR, "second") == 2 * distrust_module.FIRST
    for _ in range(20):
        seconds = distrust.accuse(LIAR, "again")
    assert seconds == distrust_module.LONGEST
    assert distrust.status()[LIAR]["accusations"] == 22
    clock[0] += distrust_module.LONGEST + distrust_module.MEMORY + 1
    distrust.status()
    assert distrust.accuse(LIAR, "after a long while") == distrust_module.FIRST  # its record was forgotten


def test_exclusions_are_bounded_in_number() -> None:
    clock = [0.0]
    distrust = Distrust(clock=lambda: clock[0], max_entries=4)
    for i in range(10):
        clock[0] += 1
        distrust.accuse(f"peer{i}", "x" * 1000)
    status = distrust.status()
    assert sorted(status) == ["peer6", "peer7", "peer8", "peer9"]
    assert all(len(str(entry["reason"])) == 300 for entry in status.values())


# --- what a record may claim ---------------------------------------------------------------------------

def test_a_state_claim_is_validated_strictly_and_bounded() -> None:
    good = record(A, 31, state=(30, D2)).model_dump()
    assert ProgressRecord.model_validate({**good, "state": {**good["state"], "future": 1}}).state == StateClaim(
        step=30, digest=D2)
    bad = {
        "ahead of the record's step": {**good, "state": {"step": 32, "digest": D2}},
        "digest not hex": {**good, "state": {"step": 30, "digest": "Z" * 64}},
        "digest too short": {**good, "state": {"step": 30, "digest": "1" * 63}},
        "step as a string": {**good, "state": {"step": "30", "digest": D2}},
        "step beyond 2**62": {**good, "step": 2**63, "state": None},
    }
    for why, value in bad.items():
        with pytest.raises(ValidationError):
            ProgressRecord.model_validate(value)
            pytest.fail(f"accepted a record with a state claim {why}")
    assert ProgressRecord.model_validate({k: v for k, v in good.items() if k != "state"}).state is None


def test_sync_mode_joining_needs_state_averaging() -> None:
    with pytest.raises(ConfigError, match="set training.state_averaging_every"):
        load_config(overrides={"training": {"state_averaging_every": 0}})
    load_config(overrides={"training": {"state_averaging_every": 0, "sync_state_on_join": False}})
    load_config(overrides={"training": {"state_averaging_every": 0, "mode": "diloco"}})
    with pytest.raises(ConfigError):
        load_config(overrides={"training": {"state_transfer": {"vouchers": -1}}})
