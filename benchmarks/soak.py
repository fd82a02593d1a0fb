"""Soak: peers train together while one of them is SIGKILLed and restarted every round.

Run: .venv/bin/python benchmarks/soak.py [--rounds 50] [--peers 4] [--config configs/lm.yaml]

Every round: SIGKILL the daemon of one non-bootstrap peer (in turn; its DHT child and p2pd must notice and
exit on their own), start a fresh one in its place, and wait until the newcomer has caught up with the step the
swarm had reached before the kill and the swarm has taken ``--steps-per-round`` more global steps. A round
that waits its whole ``--round-timeout`` is a hang. Prints per round the kill, restart and catch-up times and
each peer tree's RSS; at the end the hangs, NaN steps (a non-finite per-step loss in any peer's /history),
descendants left behind by a killed daemon, the loss curve per global step and RSS over time. Exits 1 on any
hang, NaN step or leftover descendant, or when the loss did not fall.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from peerd.control.client import normalize_url
from peerd.errors import PeerdError
from peerd.launcher import PeerProcess, alive_pids, wait_for

ROOT = Path(__file__).resolve().parents[1]
MAX_PRINTED_STEPS = 200


def get_json(control: str, path: str, timeout: float = 5.0) -> dict[str, Any]:
    with urllib.request.urlopen(normalize_url(control) + path, timeout=timeout) as response:
        data = json.load(response)
    assert isinstance(data, dict)
    return data


def training_step(peer: PeerProcess) -> int | None:
    try:
        training = peer.status(timeout=3.0).get("training")
    except PeerdError:
        return None
    return int(training["step"]) if training else None


def tree_rss_mib(peer: PeerProcess) -> float:
    peer.remember_tree()
    total = 0
    for pid in peer.alive_tree():
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total / 2**20


@dataclass
class Soak:
    config: Path
    log_dir: Path
    steps_per_round: int
    round_timeout: float
    peers: list[PeerProcess] = field(default_factory=list)
    # global step -> the per-step losses every peer reported for it (merged over restarts)
    losses: dict[int, list[float | None]] = field(default_factory=dict)
    nan_steps: list[tuple[str, int]] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    _seen: set[tuple[str, int]] = field(default_factory=set)  # (peer, step) points already counted
    restarts: int = 0

    def spawn(self, slot: int) -> PeerProcess:
        args = ["--config", str(self.config), "--control-port", "0", "--log-format", "json"]
        if slot:
            args += ["--initial-peers", self.peers[0].ready["maddrs"][0]]
        name = f"peer{slot}" if slot >= len(self.peers) else f"peer{slot}.{self.restarts}"
        return PeerProcess(name, args, self.log_dir)

    def start(self, n: int) -> None:
        self.peers.append(self.spawn(0))
        self.peers[0].wait_ready(60)
        for slot in range(1, n):
            self.peers.append(self.spawn(slot))
        for peer in self.peers[1:]:
            peer.wait_ready(60)

    def collect(self, peer: PeerProcess) -> None:
        """Adds a peer's per-step losses to the curve (the running step's point is left for the next call)."""
        try:
            curve = get_json(peer.control, "/history?points=1000")["training"]["loss"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        for _, step, loss in curve[:-1]:
            values = self.losses.setdefault(int(step), [])
            if (peer.name, step) in self._seen:
                continue
            self._seen.add((peer.name, step))
            values.append(loss)
            if loss is None or not math.isfinite(loss):
                self.nan_steps.append((peer.name, int(step)))

    def kill(self, slot: int) -> float:
        """SIGKILLs the daemon alone and waits for its descendants to exit by themselves; returns seconds."""
        victim = self.peers[slot]
        self.collect(victim)
        victim.remember_tree()
        started = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        try:
            wait_for(lambda: not alive_pids(victim._tree), 20.0, "descendants of the killed daemon", 0.05)
        except TimeoutError:
            self.leftovers += [f"{victim.name}: pid {pid}" for pid in alive_pids(victim._tree)]
        victim.kill()
        return time.monotonic() - started

    def global_step(self) -> int:
        return max((s for s in (training_step(p) for p in self.peers if p.proc.poll() is None) if s), default=0)

    def round(self, index: int, slot: int) -> dict[str, Any]:
        before = self.global_step()
        started = time.monotonic()
        kill_s = self.kill(slot)
        self.restarts += 1
        newcomer = self.spawn(slot)
        self.peers[slot] = newcomer
        deadline = started + self.round_timeout
        row: dict[str, Any] = {"round": index, "slot": slot, "step_before": before, "kill_s": round(kill_s, 2)}
        try:
            newcomer.wait_ready(max(1.0, deadline - time.monotonic()))
            row["ready_s"] = round(time.monotonic() - started, 2)
            wait_for(lambda: (training_step(newcomer) or 0) >= before, deadline - time.monotonic(),
                     "the newcomer to catch up", 0.25)
            row["caught_up_s"] = round(time.monotonic() - started, 2)
            target = before + self.steps_per_round
            wait_for(lambda: self.global_step() >= target and (training_step(newcomer) or 0) >= target,
                     deadline - time.monotonic(), "the swarm to take more steps", 0.25)
            row["hang"] = False
        except (TimeoutError, PeerdError) as e:
            row["hang"] = True
            row["why"] = str(e).splitlines()[0][:200]
        row["round_s"] = round(time.monotonic() - started, 2)
        row["step_after"] = self.global_step()
        row["rss_mib"] = [round(tree_rss_mib(p), 1) for p in self.peers]
        for peer in self.peers:
            self.collect(peer)
        return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "lm.yaml")
    parser.add_argument("--steps-per-round", type=int, default=2, help="global steps the swarm must take per round")
    parser.add_argument("--round-timeout", type=float, default=90.0, help="a round that waits this long is a hang")
    parser.add_argument("--json", type=Path, help="also write every round and the loss curve here")
    args = parser.parse_args()
    if args.peers < 2:
        parser.error("--peers must be at least 2 (peer 0 is the bootstrap and is never killed)")

    # Stop the peers on SIGTERM and on SIGINT too, which a shell ignores in background jobs.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    log_dir = Path(tempfile.mkdtemp(prefix="peerd-soak-"))
    print(f"soak: {args.peers} peers, {args.rounds} rounds, config {args.config}, logs {log_dir}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    soak = Soak(args.config, log_dir, args.steps_per_round, args.round_timeout)
    rows: list[dict[str, Any]] = []
    began = time.monotonic()
    try:
        soak.start(args.peers)
        wait_for(lambda: soak.global_step() >= 3, 120, "the swarm's first steps", 0.25)
        soak.collect(soak.peers[0])
        rss0 = [round(tree_rss_mib(p), 1) for p in soak.peers]
        print(f"swarm up after {time.monotonic() - began:.1f}s; RSS per peer tree (MiB): {rss0}")
        print("round slot step_before->after kill_s ready_s caught_up_s round_s hang rss_mib")
        for index in range(args.rounds):
            slot = 1 + index % (args.peers - 1)
            row = soak.round(index, slot)
            rows.append(row)
            print(f"{index:5d} {slot:4d} {row['step_before']:6d}->{row['step_after']:<6d} {row['kill_s']:6.2f} "
                  f"{row.get('ready_s', float('nan')):7.2f} {row.get('caught_up_s', float('nan')):11.2f} "
                  f"{row['round_s']:7.2f} {'HANG' if row['hang'] else '-':4s} {row['rss_mib']}"
                  + (f"  ({row['why']})" if row["hang"] else ""), flush=True)
    finally:
        for peer in soak.peers:
            if peer.proc.poll() is None:
                soak.collect(peer)
        for peer in reversed(soak.peers):
            peer.stop()
    return report(soak, rows, rss0, time.monotonic() - began, args.json)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def report(soak: Soak, rows: list[dict[str, Any]], rss0: list[float], seconds: float, out: Path | None) -> int:
    curve = {step: statistics.fmean(v for v in values if v is not None and math.isfinite(v))
             for step, values in sorted(soak.losses.items())
             if any(v is not None and math.isfinite(v) for v in values)}
    hangs = [row for row in rows if row["hang"]]
    items = list(curve.items())
    every = max(1, -(-len(items) // MAX_PRINTED_STEPS))
    print(f"\nloss per global step (mean over the peers that reported it), {len(curve)} steps"
          + (f", every {every}th printed (--json keeps all)" if every > 1 else "") + ":")
    shown = items[::every] + ([items[-1]] if (len(items) - 1) % every else [])
    for i in range(0, len(shown), 8):
        print("  " + "  ".join(f"{step:5d}:{loss:.4f}" for step, loss in shown[i : i + 8]))
    first = statistics.fmean(loss for _, loss in items[:5]) if items else math.nan
    last = statistics.fmean(loss for _, loss in items[-5:]) if items else math.nan
    print("\nRSS of each peer tree over time (MiB; peer 0 is never killed, the others are fresh after each kill):")
    print(f"  start: {rss0}")
    for row in rows[:: max(1, len(rows) // 10)] + rows[-1:]:
        print(f"  round {row['round']:3d}: {row['rss_mib']}")
    peer0 = [rss0[0]] + [row["rss_mib"][0] for row in rows]
    durations = [row["round_s"] for row in rows]
    print(f"\nrounds: {len(rows)}, kills: {len(rows)}, hangs (rounds that waited the full timeout): {len(hangs)}")
    print(f"NaN steps: {len(soak.nan_steps)} {soak.nan_steps[:10]}")
    print(f"descendants left running by a killed daemon: {len(soak.leftovers)} {soak.leftovers[:5]}")
    if durations:
        print(f"round time: median {statistics.median(durations):.1f}s, max {max(durations):.1f}s; "
              f"global steps {rows[0]['step_before']} -> {rows[-1]['step_after']}")
    print(f"loss: first 5 steps {first:.4f}, last 5 steps {last:.4f}")
    print(f"peer 0 RSS: start {peer0[0]:.0f} MiB, end {peer0[-1]:.0f} MiB, max {max(peer0):.0f} MiB")
    print(f"total {seconds / 60:.1f} min; load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if out is not None:
        out.write_text(json.dumps({"rounds": rows, "loss": curve, "rss_start": rss0,
                                   "nan_steps": soak.nan_steps, "leftovers": soak.leftovers}, indent=1))
    failed = bool(hangs or soak.nan_steps or soak.leftovers or not last < first)
    print("RESULT:", "FAIL" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
