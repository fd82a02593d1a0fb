"""Daemon start-up and footprint: time to ready line, time until the bootstrap peer lists a joiner, idle RSS.

Run: .venv/bin/python benchmarks/bench_startup.py [--runs 5]
Prints medians over --runs joiners that each bootstrap from one long-lived first peer, all on loopback.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _memory import tree_memory

from peerd.launcher import LocalSwarm, wait_for
from peerd.tables import format_table

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    with LocalSwarm(CONFIG, log_dir=Path(tempfile.mkdtemp(prefix="peerd-bench-"))) as swarm:
        bootstrap = swarm.add_peer()
        ready_times, listed_times = [], []
        for _ in range(args.runs):
            joiner = swarm.spawn_peer()
            joiner.wait_ready(60)
            wait_for(lambda j=joiner: j.peer_id in bootstrap.seen_peer_ids(), 60, "bootstrap to list joiner", 0.02)
            listed_times.append(time.monotonic() - joiner.started_at)
            ready_times.append(joiner.ready_after or 0.0)
            joiner.stop()

        # Idle footprint of the bootstrap once it has settled (records refreshed a few times).
        time.sleep(5)  # a measurement window, not synchronisation: let a few record refreshes happen
        bootstrap.remember_tree()
        memory = tree_memory(bootstrap.alive_tree())

    rows = [
        ["start -> ready line", f"{statistics.median(ready_times):.2f}", f"{min(ready_times):.2f}",
         f"{max(ready_times):.2f}"],
        ["start -> listed by bootstrap", f"{statistics.median(listed_times):.2f}", f"{min(listed_times):.2f}",
         f"{max(listed_times):.2f}"],
    ]
    print(f"peerd start-up over {args.runs} joiners (seconds, loopback, python startup included)")
    print(format_table(["measure", "median", "min", "max"], rows))
    print(f"\nidle daemon memory (daemon + DHT child + p2pd): RSS sum {memory.rss:.0f} MiB, PSS sum "
          f"{memory.pss:.0f} MiB  [RSS/PSS per process: {memory.describe()}]")


if __name__ == "__main__":
    main()
