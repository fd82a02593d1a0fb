"""Convergence: the LM task trained by 3 local peers with 8-bit + error feedback vs lossless fp32 averaging.

Both runs see the same number of samples: the same number of global steps of ``target_batch_size``
samples, same seeds and shards, all peers waiting for each other before the first step. Which peer
contributes how many of a step's samples depends on timing, so single runs differ by a few percent even
with identical settings: the runs alternate between the two settings and the table reports the mean and
spread over ``--repeats`` runs of each, then the ratio of the means (target: 8-bit within 1% of fp32).

Run: .venv/bin/python benchmarks/bench_convergence.py [--steps 60] [--peers 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from peerd.launcher import LocalSwarm, wait_for
from peerd.tables import format_table

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "lm.yaml"


def run(label: str, peers: int, steps: int, extra: list[str]) -> dict[str, float]:
    args = ["-o", f"training.max_steps={steps}", "-o", f"training.validation_every={steps}",
            "-o", f"training.wait_for_peers={peers}", *extra]
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
    return {
        "val_loss": sum(losses) / len(losses),
        "val_spread": max(losses) - min(losses),
        "rounds": sum(r["rounds_ok"] for r in reports) / len(reports),
        "mib_sent": sum(r["bytes_sent"] for r in reports) / len(reports) / 2**20,
        "seconds": time.monotonic() - started,
    }


SETTINGS = {
    "fp32 (lossless)": ["-o", "averaging.codec.lossless=true"],
    "8-bit + error feedback": [],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for repeat in range(args.repeats):
        for name, extra in SETTINGS.items():
            runs[name].append(run(f"{name.split()[0]}-{repeat}", args.peers, args.steps, extra))
            print(f"  {name} run {repeat + 1}: final val loss {runs[name][-1]['val_loss']:.4f}", flush=True)
    rows = []
    for name, results in runs.items():
        losses = [r["val_loss"] for r in results]
        rows.append([name, f"{statistics.mean(losses):.4f}", f"{min(losses):.4f}..{max(losses):.4f}",
                     f"{max(r['val_spread'] for r in results):.1e}", f"{statistics.mean(r['rounds'] for r in results):.0f}",
                     f"{statistics.mean(r['mib_sent'] for r in results):.1f}"])
    print(f"\nLM task, {args.peers} peers, {args.steps} global steps per run (same samples seen), {args.repeats} runs each")
    print(format_table(["averaging", "mean final val loss", "range", "max spread across peers",
                        "averaged rounds", "MiB sent/peer"], rows))
    base = statistics.mean(r["val_loss"] for r in runs["fp32 (lossless)"])
    ours = statistics.mean(r["val_loss"] for r in runs["8-bit + error feedback"])
    print(f"\n8-bit / fp32 mean final validation loss: {ours / base:.4f} ({(ours / base - 1) * 100:+.2f}%)")


if __name__ == "__main__":
    main()
