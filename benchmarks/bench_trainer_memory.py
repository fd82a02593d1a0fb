"""Resident memory of a trainer's model-sized tensors, per trainable parameter, in sync and diloco mode.

For each mode a fresh process (measured alone) builds ``--config``'s task, then what a trainer holds for it:
the model, its optimizer (eager slots), the error-feedback residuals and the staging buffers
(``peerd.training.local.LocalModel``), and in diloco mode the outer state (shared parameters, anchor, outer
momentum, pseudo-gradient and average: ``peerd.training.diloco.outer.OuterState``). It then takes
``--steps`` micro-batches with their optimizer steps. Printed: resident memory (RSS) once torch and peerd are
imported (and the modules torch loads with its first optimizer), after the task (and its model) was built,
with the trainer's tensors, and after the steps, and the growth per trainable parameter from the first to the third and to the last (gradients and what the allocator
keeps of the activations). The growth includes what the allocator keeps of
the activations, not the rounds' transient payloads (a chunk at a time) or p2pd's and the DHT's processes.

Run: .venv/bin/python benchmarks/bench_trainer_memory.py [--config configs/lm-wan.yaml] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(config_path: str, mode: str, steps: int) -> dict[str, float]:
    """In this process: RSS before and after a trainer's tensors for ``mode``."""
    import torch

    from peerd.config import load_config
    from peerd.tasks import build_task
    from peerd.training.diloco.outer import OuterState
    from peerd.training.local import LocalModel

    config = load_config(Path(config_path), overrides={"training": {"mode": mode}}).training
    # torch's first optimizer imports ~800 more modules (torch._dynamo and what it needs): a fixed cost per
    # process, not per parameter
    torch.optim.Adam(torch.nn.Linear(2, 2).parameters())
    imported = resident_mib()
    task = build_task(config.task, shard_index=0)
    built = resident_mib()
    local = LocalModel(config, task, error_feedback=True)
    outer = OuterState(config.diloco, local) if mode == "diloco" else None
    constructed = resident_mib()
    batches = task.train_batches()
    for _ in range(steps):
        _, samples = local.forward_backward(next(batches))
        if mode == "diloco":
            local.inner_step(samples)
        else:
            local.apply(local.flat_mean_grad(samples))
    after = resident_mib()
    del outer  # held until here
    return {"numel": local.numel, "imported": imported, "built": built, "constructed": constructed, "after": after,
            "held": (constructed - imported) * 2**20 / local.numel, "per_param": (after - imported) * 2**20 / local.numel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "lm-wan.yaml"))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.config, args.child, args.steps)))
        return
    print(f"{datetime.now():%Y-%m-%d %H:%M} {' '.join(sys.argv)}; load average {os.getloadavg()}")
    for mode in ("sync", "diloco"):
        out = subprocess.run([sys.executable, __file__, "--config", args.config, "--steps", str(args.steps),
                              "--child", mode], check=True, capture_output=True, text=True, cwd=ROOT)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{mode:7s} {r['numel'] / 1e6:.1f}M trainable parameters: RSS {r['imported']:.0f} MiB with torch and "
              f"peerd imported, {r['built']:.0f} MiB with the task and its model, {r['constructed']:.0f} MiB with "
              f"the trainer's tensors ({r['held']:.1f} bytes per parameter), {r['after']:.0f} MiB after "
              f"{args.steps} steps ({r['per_param']:.1f} bytes per parameter)")


if __name__ == "__main__":
    main()
