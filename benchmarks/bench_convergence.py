"""Convergence: the LM task trained by 3 local peers with 8-bit + error feedback vs lossless fp32 averaging.

Both settings must see exactly the same samples, or the comparison measures timing instead of the codec.
In peerd's default mode a peer contributes whatever it accumulated when the swarm reached
``target_batch_size``, so which peer adds how many samples to a step depends on CPU scheduling, and two fp32
runs of one config ended +-1.5% apart: more than the 1% the target asks to resolve. So the peers run in
lockstep mode (``training.samples_per_step``, peerd/training/lockstep.py): each contributes exactly
``--samples-per-step`` samples from its seeded shard (``training.task.shard_index`` = its index) to every
global step, waits for the others, and the group is ordered by shard, so every run of a setting averages
the same gradients the same way. All peers wait for each other before the first step
(``training.wait_for_peers``). What is left is floating-point summation order inside the all-reduce (a
reducer adds contributions as they arrive), so the table reports the fp32 runs' own spread: the 8-bit vs
fp32 difference means something only well above it. ``--timing`` runs the default mode instead, to see
the spread it has.

A run whose rounds did not all include every peer (a peer left out by matchmaking, a solo step, a state
sync) is flagged: it is no longer deterministic.

``--compare aggregation`` instead compares the aggregation rules without attackers: ``mean`` against the
robust default ``centered_clip`` (both 8-bit + error feedback); the target is within 1%.

``--mode diloco`` runs the peers in diloco mode (``training.diloco.phase_end: lockstep``: each peer takes
exactly ``--inner-steps`` micro-batches per phase and waits for the others) for the same number of samples
per peer as ``--steps`` sync steps would use; ``--steps`` must make whole phases. With ``--compare codec`` it
compares 8-bit + error feedback against fp32 pseudo-gradients (target within 1%); these runs turn overlap
off, since with overlap the inner step at which an average lands depends on timing and the runs stop being
repeatable; top-k pseudo-gradients (``averaging.codec.scheme=topk``, 1.56% of each payload's elements at 2
bits, with error feedback) run beside them, measured against the 8-bit runs (target within 2%, the bytes of a
round included). ``--compare mode`` compares sync mode against diloco with overlap (the default) at equal samples
(target within 3%). ``--compare widths`` compares 4- and 2-bit codes and top-k at 1.56% with 2-bit values
(``averaging.codec.scheme``, with error feedback) against 8-bit, the bytes of a round included (target: within
2%; use it with ``--mode diloco``). ``--compare checks`` runs 8-bit, top-k whose reducers return their averages
as top-k with their residual, unchecked (``averaging.verification.check_narrow_codes=false``), and top-k whose
reducers return the average's largest elements at 8 bits, checked (the default), at 1.56% and 1% density: what
checking costs in bytes and loss.

Run: .venv/bin/python benchmarks/bench_convergence.py [--steps 60] [--peers 3] [--repeats 2]
     [--samples-per-step 32] [--timing] [--compare codec|aggregation|mode|widths|checks] [--mode sync|diloco]
     [--inner-steps 20] [-o KEY=VALUE (any peerd option, every setting, e.g. training.diloco.outer_lr=0.1)]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from peerd.launcher import LocalSwarm, wait_for
from peerd.tables import format_table

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "lm.yaml"
FP32, EIGHT_BIT = "fp32 (lossless)", "8-bit + error feedback"
FOUR_BIT, TWO_BIT = "4-bit + error feedback", "2-bit + error feedback"
TOP_K = "top-k 1.56%, 2-bit values + error feedback"
TOP_K_UNCHECKED = "top-k 1.56%, 2-bit, averages returned as top-k, unchecked"
TOP_K_1 = "top-k 1%, 2-bit values + error feedback"
MEAN, ROBUST = "mean", "centered_clip"
TOP_K_MEAN = ["-o", "averaging.aggregation=mean", "-o", "averaging.codec.scheme=topk",
              "-o", "averaging.codec.density=0.0156", "-o", "averaging.codec.value_bits=2"]
# comparison -> {setting: its overrides}; the first setting is the baseline the second is measured against
COMPARISONS = {
    "codec": {FP32: ["-o", "averaging.codec.lossless=true", "-o", "averaging.aggregation=mean"],
              EIGHT_BIT: ["-o", "averaging.aggregation=mean"],
              TOP_K: TOP_K_MEAN},
    # what checking top-k averages costs: reducers return SPARSE8 (the default) or top-k with their residual,
    # and checked top-k at a lower density
    "checks": {EIGHT_BIT: ["-o", "averaging.aggregation=mean"],
               TOP_K_UNCHECKED: [*TOP_K_MEAN, "-o", "averaging.verification.check_narrow_codes=false"],
               TOP_K: TOP_K_MEAN,
               TOP_K_1: ["-o", "averaging.aggregation=mean", "-o", "averaging.codec.scheme=topk",
                         "-o", "averaging.codec.density=0.01", "-o", "averaging.codec.value_bits=2"]},
    # top-k's residual carries what rounds leave out, as an outer momentum would: both, or the residual alone
    "momentum": {f"{TOP_K}, outer momentum 0.9": [*TOP_K_MEAN, "-o", "training.diloco.outer_momentum=0.9"],
                 f"{TOP_K}, outer momentum 0": [*TOP_K_MEAN, "-o", "training.diloco.outer_momentum=0"]},
    "aggregation": {MEAN: ["-o", "averaging.aggregation=mean"], ROBUST: ["-o", "averaging.aggregation=centered_clip"]},
    "mode": {"sync": ["-o", "training.mode=sync"], "diloco": ["-o", "training.mode=diloco"]},
    "widths": {EIGHT_BIT: ["-o", "averaging.aggregation=mean"],
               FOUR_BIT: ["-o", "averaging.aggregation=mean", "-o", "averaging.codec.scheme=blockwise4"],
               TWO_BIT: ["-o", "averaging.aggregation=mean", "-o", "averaging.codec.scheme=blockwise2"],
               TOP_K: TOP_K_MEAN},
}
MICRO_BATCH = 16  # configs/lm.yaml's task uses the lm task's default batch_size


def run(label: str, peers: int, steps: int, mode: list[str], extra: list[str]) -> dict[str, Any]:
    """``steps``: global steps, or phases in diloco mode."""
    args = ["-o", f"training.max_steps={steps}", "-o", f"training.validation_every={steps}",
            "-o", f"training.wait_for_peers={peers}", *mode, *extra]
    started = time.monotonic()
    with LocalSwarm(CONFIG, log_dir=Path(tempfile.mkdtemp(prefix=f"peerd-conv-{label}-")), extra_args=args) as swarm:
        for index in range(peers):
            peer = swarm.spawn_peer(["-o", f"training.task.shard_index={index}"])
            if index == 0:
                peer.wait_ready(60)
        for peer in swarm.peers:
            peer.wait_ready(60)

        def finished() -> bool:
            # validation runs right after the last step; wait for its result, not just the step count
            return all(((p.status()["training"] or {}).get("validation_step") or 0) >= steps for p in swarm.peers)

        wait_for(finished, 3600, f"{label}: {steps} steps", 2.0)
        reports = [p.status()["training"] for p in swarm.peers]
        swarm.stop()
    losses = [r["validation_loss"] for r in reports]
    full = min(int(r.get("group_sizes", {}).get(str(peers), 0)) for r in reports)
    return {
        "val_loss": sum(losses) / len(losses),
        "val_spread": max(losses) - min(losses),
        "full_rounds": full,  # rounds that averaged every peer, on the peer with the fewest
        "deterministic": full == steps and all(r["rounds_solo"] == 0 and r["state_syncs"] == 0 for r in reports),
        "mib_sent": sum(r["bytes_sent"] for r in reports) / len(reports) / 2**20,
        # the last gradient or pseudo-gradient round: what one round moves, without state averaging
        "round_kib": sum(r["last_round"]["bytes_sent"] for r in reports) / len(reports) / 2**10,
        "steps": steps,
        "seconds": time.monotonic() - started,
        "log_dir": str(swarm.log_dir),
    }


def relative_spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.mean(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--samples-per-step", type=int, default=32,
                        help="each peer's share of a global step (whole micro-batches of 16 sequences)")
    parser.add_argument("--timing", action="store_true",
                        help="peerd's default mode instead of lockstep: shares depend on timing")
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="codec",
                        help="codec: 8-bit vs fp32 averaging; aggregation: centered_clip vs mean (8-bit); mode: "
                        "sync vs diloco at equal samples; widths: 4- and 2-bit vs 8-bit codes; checks: top-k "
                        "averages checked vs unchecked")
    parser.add_argument("--mode", choices=["sync", "diloco"], default="sync", help="training.mode of the runs")
    parser.add_argument("--inner-steps", type=int, default=20, help="diloco: micro-batches per peer per phase")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a peerd option for every run of every setting")
    args = parser.parse_args()
    settings = COMPARISONS[args.compare]
    sync_mode = ["-o", f"training.samples_per_step={args.samples_per_step}"]
    micro_batches = args.steps * args.samples_per_step // MICRO_BATCH
    phases = micro_batches // args.inner_steps
    diloco_mode = ["-o", "training.mode=diloco", "-o", "training.diloco.phase_end=lockstep",
                   "-o", f"training.diloco.inner_steps={args.inner_steps}"]
    if (args.mode == "diloco" or args.compare == "mode") and (
            args.timing or micro_batches % args.inner_steps or args.samples_per_step % MICRO_BATCH):
        parser.error(f"--steps x --samples-per-step must be whole phases of --inner-steps micro-batches of "
                     f"{MICRO_BATCH}, without --timing")
    if args.timing:
        mode = ["-o", f"training.target_batch_size={args.samples_per_step * args.peers}"]
        mode_text = f"default mode, target_batch_size {args.samples_per_step * args.peers}"
    elif args.compare == "mode":
        mode = []
        mode_text = (f"equal samples: sync lockstep {args.samples_per_step} sequences per peer x {args.steps} steps; "
                     f"diloco {phases} phases of {args.inner_steps} micro-batches per peer, overlapped")
    elif args.mode == "diloco":
        mode = [*diloco_mode, "-o", "training.diloco.overlap=false"]
        mode_text = f"diloco lockstep, {phases} phases of {args.inner_steps} micro-batches per peer, no overlap"
    else:
        mode = sync_mode
        mode_text = f"lockstep, {args.samples_per_step} sequences per peer per step"
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    for repeat in range(args.repeats):
        for name, extra in settings.items():
            steps = args.steps
            if args.compare == "mode":
                extra = sync_mode if name == "sync" else diloco_mode
                steps = args.steps if name == "sync" else phases
            elif args.mode == "diloco":
                steps = phases
            overrides = [arg for option in args.override for arg in ("-o", option)]
            result = run(f"{name.split()[0]}-{repeat}", args.peers, steps, mode, [*extra, *overrides])
            runs[name].append(result)
            flag = "" if result["deterministic"] or args.timing else (
                f"  NOT DETERMINISTIC: only {result['full_rounds']} of {steps} rounds averaged every peer "
                f"(logs: {result['log_dir']})")
            print(f"  {name} run {repeat + 1}: final val loss {result['val_loss']:.6f} "
                  f"({result['seconds']:.0f} s){flag}", flush=True)
    rows = []
    for name, results in runs.items():
        losses = [r["val_loss"] for r in results]
        rows.append([
            name, f"{statistics.mean(losses):.5f}", " ".join(f"{x:.6f}" for x in losses),
            f"{relative_spread(losses):.1e}", f"{max(r['val_spread'] for r in results):.1e}",
            f"{min(r['full_rounds'] for r in results)}/{results[0]['steps']}",
            f"{statistics.mean(r['mib_sent'] for r in results):.1f}",
            f"{statistics.mean(r['round_kib'] for r in results):.1f}",
        ])
    print(f"\nload average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"LM task, {args.peers} peers, {args.steps * args.samples_per_step} samples per peer per run ({mode_text}), "
          f"{args.repeats} runs each, overrides: {' '.join(args.override) or 'none'}")
    print(format_table(["averaging", "mean final val loss", "per-run final val loss", "run-to-run spread (rel.)",
                        "max spread across peers", "rounds with all peers", "MiB sent/peer",
                        "KiB sent/peer, last round"], rows))
    for name in list(settings)[1:]:
        # top-k is measured against 8-bit wherever both run; the rest against the first setting
        base_name = EIGHT_BIT if name == TOP_K else next(iter(settings))
        base = statistics.mean(r["val_loss"] for r in runs[base_name])
        base_spread = relative_spread([r["val_loss"] for r in runs[base_name]])
        base_kib = statistics.mean(r["round_kib"] for r in runs[base_name])
        target = 2 if name in (TOP_K, TOP_K_UNCHECKED, TOP_K_1) else {"mode": 3, "widths": 2}.get(args.compare, 1)
        ours = statistics.mean(r["val_loss"] for r in runs[name])
        kib = statistics.mean(r["round_kib"] for r in runs[name])
        print(f"\n{name} / {base_name} mean final validation loss: {ours / base:.5f} ({(ours / base - 1) * 100:+.3f}%); "
              f"{base_name} run-to-run spread {base_spread * 100:.3f}% (target: {name} within {target}% of "
              f"{base_name}); a round sends {base_kib / kib:.2f}x fewer bytes"
              + (f" ({statistics.mean(r['round_kib'] for r in runs[FP32]) / kib:.1f}x fewer than {FP32})"
                 if FP32 in runs and base_name != FP32 else ""))


if __name__ == "__main__":
    main()
