"""A member hosting experts that answers with noise a thousand times what an expert computes, against a trainer
that calls it.

A trainer serves ffn.1.0 itself, an honest host serves ffn.1.1, and a third member serves ffn.1.2 and ffn.1.3
with :class:`tests.integration.loud_expert.LoudExpert`: finite answers of the right shape and dtype, so every
check of a call's answer passes. Without the bound on answers (``moe.max_answer_ratio: null``) the noise swamps
every token routed to those experts and the trainer's validation loss stays far above an attack-free run's; with
it (the default) each of the liar's answers is left out as over the bound, its experts are skipped, and the loss
follows the attack-free run's. No answer of the honest host is ever left out.

The trainer reads one fixed data shard in every run: by default its shard follows from its peer id, a new one each
run, and two attack-free runs on different shards differed by more than the 10% band (mean validation loss 3.2
against 3.8 over 30 steps). On one shard they agree within 0.01.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from peerd.launcher import LocalSwarm, wait_for
from tests.helpers import MOE_CONFIG, PATCHED_ENV, called, experts_option, training, validations

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

STEPS = 30  # validations every 5 steps
HOST = ["-o", "training.enabled=false", "-o", "swarm.roles=[expert_host]"]
LIAR = ", module: 'tests.integration.loud_expert:LoudExpert', module_options: {ffn_dim: 64, factor: 1000.0, noise: true}}"


def run(log_dir: Path, liar: bool, bounded: bool = True) -> tuple[float, dict[str, dict[str, int]], set[str]]:
    """The trainer's mean validation loss over steps 5..STEPS, its forward calls and answers out of bound per
    expert, and the hosts ("honest", "third") it skipped for an answer out of bound."""
    log_dir.mkdir(parents=True)
    config = log_dir / "moe.yaml"
    config.write_text(MOE_CONFIG)
    third = experts_option(2, 2)
    if liar:
        third = third[:-1] + LIAR
    with LocalSwarm(config, log_dir=log_dir, env=PATCHED_ENV) as swarm:
        honest = swarm.add_peer([*HOST, "-o", f"experts={experts_option(1, 1)}"], timeout=90)
        hosts = {honest.peer_id: "honest", swarm.add_peer([*HOST, "-o", f"experts={third}"], timeout=90).peer_id: "third"}
        # both experts of every token answer before the layer goes on (not the trainer's own first, then 50 ms
        # of grace for the others): which answers count does not hang on the machine's load
        args = ["-o", f"experts={experts_option(1, 0)}", "-o", "training.task.shard_index=5",
                "-o", "training.task.options.moe.k_min=2", "-o", "training.task.options.moe.grace=1.0"]
        if not bounded:
            args += ["-o", "training.task.options.moe.max_answer_ratio=null"]
        trainer = swarm.add_peer(args, timeout=90)
        wait_for(lambda: (training(trainer)["validation_step"] or 0) >= STEPS, 300, f"step {STEPS}", 0.5)
        losses = [loss for step, loss in validations(trainer) if step <= STEPS]
        calls = {f"ffn.1.{i}": {"calls": int(called(trainer, f"ffn.1.{i}").get("forward", {}).get("calls", 0)),
                                "out_of_bound": int(called(trainer, f"ffn.1.{i}").get("forward", {})
                                                    .get("out_of_bound", 0))}
                 for i in range(4)}
        log = trainer.log_path.read_text(errors="replace")
        skipped = {name for peer, name in hosts.items() if f"at {peer} answered out of bound" in log}
    mean = sum(losses) / len(losses)
    print(f"liar={liar}, bounded={bounded}: validation losses {[round(x, 3) for x in losses]}, mean {mean:.3f}; "
          f"forward calls {calls}")
    return mean, calls, skipped


def test_an_expert_host_answering_noise_is_left_out_and_changes_nothing(tmp_path: Path) -> None:
    free, _, skipped = run(tmp_path / "attack-free", liar=False)
    assert not skipped, f"no honest host should be skipped: {skipped}"
    undefended, _, _ = run(tmp_path / "undefended", liar=True, bounded=False)
    assert undefended > 1.1 * free, f"without the bound the noise should have held the loss up: {undefended} vs {free}"
    defended, calls, skipped = run(tmp_path / "defended", liar=True)
    assert defended <= 1.1 * free, f"with the bound the loss should follow the attack-free run's: {defended} vs {free}"
    for uid in ("ffn.1.2", "ffn.1.3"):  # each of the liar's answers left out, and its experts skipped
        assert calls[uid]["out_of_bound"] == calls[uid]["calls"], calls
        assert calls[uid]["calls"] <= 8, calls  # skipped for retry_after (1 s here), doubling: not called every pass
    assert calls["ffn.1.1"]["calls"] > 20 and skipped == {"third"}, (calls, skipped)
