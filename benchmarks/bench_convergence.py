"""Convergence: the LM task trained by 3 local peers with 8-bit + error feedback vs lossless fp32 averaging.

Both runs see the same samples: the same number of global steps of ``target_batch_size`` samples, same
seeds and shards, all peers waiting for each other before the first step. Prints the validation loss at
the end of each run and their ratio (target: 8-bit within 1% of fp32).

Run: .venv/bin/python benchmarks/bench_convergence.py [--steps 80] [--peers 3]
"""

from __future__ import annotations

import argparse
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
            return all((p.status()["training"] or {}).get("step", 0) >= steps for p in swarm.peers)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--peers", type=int, default=3)
    args = parser.parse_args()
    results = {
        "fp32 (lossless)": run("fp32", args.peers, args.steps, ["-o", "averaging.codec.lossless=true"]),
        "8-bit + error feedback": run("int8", args.peers, args.steps, []),
    }
    rows = [[name, f"{r['val_loss']:.4f}", f"{r['val_spread']:.1e}", f"{r['rounds']:.0f}", f"{r['mib_sent']:.1f}",
             f"{r['seconds']:.0f}"] for name, r in results.items()]
    print(f"LM task, {args.peers} peers, {args.steps} global steps each (same samples seen)")
    print(format_table(["averaging", "final val loss", "spread across peers", "averaged rounds",
                        "MiB sent/peer", "wall s"], rows))
    base, ours = results["fp32 (lossless)"]["val_loss"], results["8-bit + error feedback"]["val_loss"]
    print(f"\n8-bit / fp32 final validation loss: {ours / base:.4f} ({(ours / base - 1) * 100:+.2f}%)")


if __name__ == "__main__":
    main()
