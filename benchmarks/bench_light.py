"""Memory of a light peer (no training, no experts: a bootstrap or relay node) beside a training peer.

One training peer (``--config``, configs/synthetic.yaml: training on) starts and trains; then, one after the
other and each beside it, a light peer of the same config with ``training.enabled=false`` as peerd starts it
now (its DHT on the daemon's event loop), and the same light peer as it started before ``peerd.footprint``
(hivemind's whole package imported, torch's ``file_system`` sharing with its ``torch_shm_manager``, the DHT
in hivemind's child process). Each light peer joins the trainer's swarm;
once the trainer lists it and ``--settle`` seconds have passed, the whole process tree of both is measured.

Printed: RSS, PSS and USS summed over each tree (MiB), per process RSS/PSS, and the light peer's PSS against
the baseline's. PSS splits pages shared between processes (torch's libraries are mapped by both peers' trees),
so it is the figure that sums to the machine's real use.

With ``--alone``, one light peer of configs/local.yaml (or ``--config``) runs with nothing beside it, as a
bootstrap peer on a small server would, and only its tree is measured.

Run: .venv/bin/python benchmarks/bench_light.py [--settle 10] [--no-baseline | --alone]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _memory import TreeMemory, process_tree, tree_memory

from peerd.launcher import PeerProcess, wait_for
from peerd.tables import format_table

CONFIG = HERE.parent / "configs" / "synthetic.yaml"
ALONE_CONFIG = HERE.parent / "configs" / "local.yaml"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def start_light(name: str, config: Path, bootstrap: PeerProcess, log_dir: Path, module: str) -> PeerProcess:
    args = ["--config", str(config), "--control-port", "0", "-o", "training.enabled=false",
            "--initial-peers", bootstrap.ready["maddrs"][0]]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    peer = PeerProcess(name, args, log_dir, env=env, module=module)
    peer.wait_ready(120)
    wait_for(lambda: peer.peer_id in bootstrap.seen_peer_ids(), 60, f"the trainer to list {name}")
    return peer


def measure_beside(trainer: PeerProcess, light: PeerProcess, settle: float) -> tuple[TreeMemory, TreeMemory]:
    time.sleep(settle)  # a measurement window, not synchronisation: records refreshed, trainer stepping
    return tree_memory(process_tree(trainer.proc.pid)), tree_memory(process_tree(light.proc.pid))


def alone(config: Path, settle: float, log_dir: Path) -> None:
    peer = PeerProcess("alone", ["--config", str(config), "--control-port", "0"], log_dir)
    try:
        peer.wait_ready(120)
        time.sleep(settle)  # a measurement window, not synchronisation: records refreshed, views checked
        mem = tree_memory(process_tree(peer.proc.pid))
    finally:
        peer.stop()
    print(f"bench_light --alone {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load {load()}, "
          f"config {config.name}, settle {settle:g}s")
    print(format_table(["peer tree", "RSS MiB", "PSS MiB", "of it anon", "of it files", "USS MiB",
                        "per process RSS/PSS"],
                       [["light, alone", f"{mem.rss:.0f}", f"{mem.pss:.0f}", f"{mem.pss_anon:.0f}",
                         f"{mem.pss_file:.0f}", f"{mem.uss:.0f}", mem.describe()]]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", type=Path, default=None, help=f"default {CONFIG.name} ({ALONE_CONFIG.name} alone)")
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--no-baseline", action="store_true", help="measure only the light peer as it is now")
    parser.add_argument("--alone", action="store_true", help="one light peer with nothing beside it")
    args = parser.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="peerd-bench-light-"))
    if args.alone:
        alone(args.config or ALONE_CONFIG, args.settle, log_dir)
        return
    args.config = args.config or CONFIG
    rows: list[list[str]] = []
    pss: dict[str, float] = {}
    variants = [("light", "peerd")] + ([] if args.no_baseline else [("light, before", "_full_hivemind_peer")])
    trainer = PeerProcess("trainer", ["--config", str(args.config), "--control-port", "0"], log_dir)
    try:
        trainer.wait_ready(120)
        wait_for(lambda: (trainer.status().get("training") or {}).get("step", 0) >= 1 or None, 120,
                 "the trainer's first step")
        for label, module in variants:
            light = start_light(label.replace(", ", "-").replace(" ", "-"), args.config, trainer, log_dir, module)
            try:
                trained, lit = measure_beside(trainer, light, args.settle)
            finally:
                light.stop()
            pss[label] = lit.pss
            for who, mem in ((f"training (beside {label})", trained), (label, lit)):
                rows.append([who, f"{mem.rss:.0f}", f"{mem.pss:.0f}", f"{mem.pss_anon:.0f}", f"{mem.pss_file:.0f}",
                             f"{mem.uss:.0f}", mem.describe()])
    finally:
        trainer.stop()

    print(f"bench_light {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, load {load()}, "
          f"config {args.config.name}, settle {args.settle:g}s")
    print(format_table(["peer tree", "RSS MiB", "PSS MiB", "of it anon", "of it files", "USS MiB",
                        "per process RSS/PSS"], rows))
    if "light, before" in pss:
        print(f"\nlight peer tree PSS: {pss['light']:.0f} MiB now vs {pss['light, before']:.0f} MiB before "
              f"({pss['light'] / pss['light, before']:.2f}x)")


if __name__ == "__main__":
    main()
