"""What a member that lies about its progress and state does to the honest members in a minute, with and without
the checks of claims.

Three honest `peerd start` processes of ``--config`` (configs/synthetic.yaml, plain sync mode as a user runs it)
train until each is past step ``--warmup``; then, unless the row is ``clean``, the attacker of
tests/integration/state_attacker.py joins: its progress records claim a step 30,000 ahead of the furthest honest
member, and it serves finite noise of the right shapes (``noise``) or noise with one NaN (``nan``) as its state,
under its own digest (the claim nobody else makes). ``idle``: the same process telling no lie (it computes
nothing and joins no round), what a fourth process costs three on the same cores. The honest members run as `peerd` (``defended``) or as
tests/integration/undefended.py (``undefended``: they believe every member's word, as peerd did before the
checks). Measured over ``--seconds`` from the moment the attacker is up (or the warm-up ended):

  rounds/min  gradient rounds averaged in a group (``rounds_ok``) per minute, mean over the honest members
  steps       how far their step counter moved (a reload to a claimed step moves it by the claim)
  reloads     states loaded (``state_syncs``); failed loads (``state_sync_failures``)
  val loss    the last validation loss before -> after (every ``training.validation_every`` steps: a peer
              that reloads every step or two rarely validates), mean; ``inf`` when not finite
  train loss  the moving average of the micro-batch losses, before -> after: the model being trained now

Run from the repository root (2 cores are enough; the rows are comparable only at similar load):
    .venv/bin/python benchmarks/bench_state_attack.py [--rows clean,noise-undefended,...] [--seconds 60]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from statistics import mean
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from peerd.launcher import LocalSwarm, PeerProcess, wait_for
from peerd.tables import format_table

ROWS = ["clean", "idle", "noise-undefended", "noise-defended", "nan-undefended", "nan-defended"]
HEADERS = ["row", "rounds/min", "steps", "reloads", "failed loads", "val loss", "train loss", "s"]
FIELDS = ("step", "rounds_ok", "state_syncs", "state_sync_failures", "validation_loss", "loss")


def spawn(swarm: LocalSwarm, name: str, module: str, env: dict[str, str] | None = None) -> PeerProcess:
    args = ["--config", str(swarm.config_path), "--control-port", "0", *swarm.extra_args]
    if module == "tests.integration.undefended":
        args += ["--undefended", "claims"]
    if swarm.peers:
        args += ["--initial-peers", swarm.peers[0].ready["maddrs"][0]]
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    peer = PeerProcess(name, args, swarm.log_dir, env={"PYTHONPATH": path, **(env or {})}, module=module)
    swarm.peers.append(peer)
    return peer


def snapshot(peers: list[PeerProcess]) -> list[dict[str, Any]]:
    reports = [p.status()["training"] for p in peers]
    return [{k: r[k] for k in FIELDS} for r in reports]


def loss(values: list[dict[str, Any]], key: str = "validation_loss") -> str:
    losses = [v[key] for v in values]
    finite = [x for x in losses if x is not None and math.isfinite(x)]
    return f"{mean(finite):.3g}" if len(finite) == len(losses) else "inf"


def row(name: str, args: argparse.Namespace, log_dir: Path) -> list[Any]:
    attack, _, defence = name.partition("-")
    module = "tests.integration.undefended" if defence == "undefended" else "peerd"
    log_dir.mkdir()
    with LocalSwarm(Path(args.config), log_dir=log_dir, extra_args=["-o", "training.wait_for_peers=3"]) as swarm:
        honest = [spawn(swarm, "honest0", module)]
        honest[0].wait_ready(60)
        honest += [spawn(swarm, f"honest{i}", module) for i in (1, 2)]
        for peer in honest:
            peer.wait_ready(60)
        wait_for(lambda: all(p.status()["training"]["step"] >= args.warmup for p in honest), 300,
                 f"every honest member past step {args.warmup}", 0.5)
        if attack == "idle":
            spawn(swarm, "idle", "tests.integration.state_attacker", env={"PEERD_ATTACK_STATE": "none"}).wait_ready(60)
        elif attack != "clean":
            spawn(swarm, "attacker", "tests.integration.state_attacker",
                  env={"PEERD_ATTACK_STATE": attack}).wait_ready(60)
        before, began = snapshot(honest), time.monotonic()
        time.sleep(args.seconds)  # the measured window itself, not a synchronisation guess
        after, seconds = snapshot(honest), time.monotonic() - began

    def delta(key: str) -> float:
        return mean(a[key] - b[key] for a, b in zip(after, before, strict=True))

    return [name, f"{delta('rounds_ok') * 60 / seconds:.0f}",
            f"{mean(b['step'] for b in before):.0f} -> {mean(a['step'] for a in after):.0f}",
            f"{delta('state_syncs'):.1f}", f"{delta('state_sync_failures'):.1f}",
            f"{loss(before)} -> {loss(after)}", f"{loss(before, 'loss')} -> {loss(after, 'loss')}", f"{seconds:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "synthetic.yaml"))
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {ROWS}")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=int, default=50, help="steps before the attacker joins")
    args = parser.parse_args()
    started = datetime.now().isoformat(timespec="seconds")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    table = []
    with tempfile.TemporaryDirectory(prefix="bench-state-attack-") as tmp:
        for i, name in enumerate(args.rows.split(",")):
            table.append(row(name, args, Path(tmp) / f"{i}-{name}"))
            print(format_table(HEADERS, table[-1:]), flush=True)
    print(f"\n{started}, {os.cpu_count()} cores, load before: {load}, after: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(format_table(HEADERS, table))


if __name__ == "__main__":
    main()
