"""A member gone bad, with real processes: one peer of 4 sends its gradient times -1000 and claims 10x its
samples (tests/integration/attacker.py, a patched `peerd start`). With the robust default the honest peers
train as if it were not there; with `mean` they do not, which shows the defence is what makes the difference.

Once with the default 8-bit codec and once with top-k payloads (a quarter of each chunk's elements, 2-bit
values, error feedback): the reducer clips what it decodes, a dense row with the attacker's values where they
were sent and zeros elsewhere, so which elements an attacker sends changes nothing about how far it is clipped.

The synthetic task in lockstep mode (two micro-batches of 32 samples per peer per step, shards 0-3, the
attacker on shard 0), so every run sees the same samples. A reducer decides for its span (a bad reducer is outside this
threat), so the attacker must reduce nothing: it is first in the shard-ordered group, and spans are whole
128-element codec blocks, so the last member (honest, shard 3) reduces all 33 parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from peerd.launcher import LocalSwarm, PeerProcess, wait_for
from tests.helpers import LR, PATCHED_ENV, SHARE, SYNTHETIC, validated_or_diverged, validation_loss

pytestmark = pytest.mark.integration

STEPS = 30
PEERS = 4
ATTACKER_SHARD = 0
# codec -> its overrides; the synthetic model's 33 parameters are below min_compress_numel unless it is 0
CODECS = {
    "blockwise8": [],
    "topk": ["-o", "averaging.codec.scheme=topk", "-o", "averaging.codec.density=0.25",
             "-o", "averaging.codec.value_bits=2", "-o", "averaging.codec.min_compress_numel=0"],
}
# How far from the attack-free run the robust one may end: with the attacker left out, it trains on three shards
# where the attack-free run trains on four, and top-k's sparse steps carry those shards' difference further
# than 8-bit's dense ones; `mean` must end outside it.
TOLERANCE = {"blockwise8": 0.10, "topk": 0.25}


def spawn(swarm: LocalSwarm, shard: int, attacker: bool) -> PeerProcess:
    args = ["--config", str(swarm.config_path), "--control-port", "0", *swarm.extra_args,
            "-o", f"training.task.shard_index={shard}"]
    if swarm.peers:
        args += ["--initial-peers", swarm.peers[0].ready["maddrs"][0]]
    module = "tests.integration.attacker" if attacker else "peerd"
    peer = PeerProcess(f"peer{len(swarm.peers)}{'-attacker' if attacker else ''}", args, swarm.log_dir,
                       env=PATCHED_ENV,
                       module=module)
    swarm.peers.append(peer)
    return peer


def train(log_dir: Path, aggregation: str, attacked: bool, codec: str) -> list[dict[str, Any]]:
    """Runs 4 peers to step STEPS (or until the honest model is no longer finite); returns the honest
    peers' training reports."""
    args = ["-o", f"training.samples_per_step={SHARE}", "-o", f"training.lr={LR}", "-o", f"training.wait_for_peers={PEERS}",
            "-o", f"training.max_steps={STEPS}", "-o", f"averaging.aggregation={aggregation}",
            "-o", f"averaging.target_group_size={PEERS}", *CODECS[codec]]
    log_dir.mkdir(parents=True, exist_ok=True)
    with LocalSwarm(SYNTHETIC, log_dir=log_dir, extra_args=args) as swarm:
        for shard in range(PEERS):
            peer = spawn(swarm, shard, attacked and shard == ATTACKER_SHARD)
            if shard == 0:
                peer.wait_ready(60)
        for peer in swarm.peers:
            peer.wait_ready(60)
        honest = [p for p in swarm.peers if not p.name.endswith("-attacker")]
        # a run took up to 100 s beside two other tests on 2 cores
        return wait_for(lambda: validated_or_diverged(honest, STEPS), 240,
                        f"{STEPS} steps ({aggregation}, {codec}, attacked={attacked})", 0.5)


@pytest.fixture(scope="module", params=sorted(CODECS))
def codec(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, codec: str) -> Iterator[float]:
    reports = train(tmp_path_factory.mktemp(f"reference-{codec}"), "mean", attacked=False, codec=codec)
    losses = [validation_loss(r) for r in reports]
    assert all(r["validation_step"] == STEPS for r in reports)
    assert len(set(losses)) == 1, f"honest peers disagree: {losses}"
    assert losses[0] is not None and math.isfinite(losses[0])
    yield losses[0]


@pytest.mark.timeout(720)  # the module's reference run (its setup) and two more runs, each up to 240 s
def test_the_robust_default_keeps_honest_peers_on_course_and_mean_does_not(
    reference: float, codec: str, tmp_path: Path
) -> None:
    robust = train(tmp_path / "centered_clip", "centered_clip", attacked=True, codec=codec)
    losses = [validation_loss(r) for r in robust]
    assert all(r["validation_step"] == STEPS for r in robust), robust
    assert len(set(losses)) == 1, f"honest peers applied different updates: {losses}"
    assert losses[0] is not None and abs(losses[0] / reference - 1) <= TOLERANCE[codec], (
        f"robust {losses[0]:.6g} vs attack-free {reference:.6g}")
    rounds = [r["last_round"] for r in robust]
    assert all(r["aggregation"] == "centered_clip" for r in rounds), rounds
    # the honest reducer of the only non-empty span says whom it clipped, by how much, and capped its weight
    clipped = next(r["clipped"] for r in rounds if r["clipped"])
    heavy = {peer: note for peer, note in clipped.items() if note["kept"] < 0.5}
    assert len(heavy) == 1, clipped
    (note,) = heavy.values()
    assert note["kept"] < 0.01 and note["weight"] == SHARE and note["claimed_weight"] == 10 * SHARE, note

    plain = train(tmp_path / "mean", "mean", attacked=True, codec=codec)
    loss = validation_loss(plain[0])
    print(f"{codec}: validation loss at step {STEPS}: attack-free {reference:.6g}, attacked with centered_clip "
          f"{losses[0]:.6g} (attacker kept {note['kept']:.2g}), attacked with mean {loss}")
    assert loss is not None and not (abs(loss / reference - 1) <= TOLERANCE[codec]), (
        f"mean {loss} vs attack-free {reference:.6g}: no harm done?")
