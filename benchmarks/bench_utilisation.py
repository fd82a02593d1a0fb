"""Compute utilisation and bytes per sample of sync vs diloco training behind shaped links.

``--peers`` (4) `peerd start` processes of ``--config`` (configs/lm-wan.yaml: a 19.2M-parameter LM whose sync
all-reduce at 100 Mbit/s takes longer than a peer's compute per step), each in its own network namespace of
benchmarks/netns.py behind a full-duplex ``--rate`` Mbit/s port (tbf both ways), train in each mode of
``--modes``, one row after the other on the same lab:

  sync               gradients all-reduced (8-bit) at every global step
  diloco-nooverlap   training.mode=diloco, training.diloco.overlap=false: compute stops while a phase's
                     pseudo-gradient is averaged
  diloco-overlap     training.mode=diloco, training.diloco.overlap=true: the average travels while the next
                     phase computes
  diloco-*-topk      either diloco row with top-k pseudo-gradients (averaging.codec.scheme=topk; the others
                     send 8-bit ones)

Equal samples. Every row computes exactly ``--samples`` sequences on every peer, in lockstep: in sync mode
``training.samples_per_step`` = ``--sync-micro-batches`` x batch_size (each peer adds exactly that to every
global step and waits for the others), in diloco mode ``training.diloco.phase_end=lockstep`` (each peer takes
exactly ``--inner-steps`` inner steps, one micro-batch each, per phase). ``training.max_steps`` is then
samples / samples_per_step global steps, or samples / (inner_steps x batch_size) phases, and each peer reads
its own shard (``training.task.shard_index``). The alternative, the default timing-driven modes
(target_batch_size; phase_end=swarm), fixes only the swarm's total: faster peers compute more, and the status
has no count of the samples a peer computed to check it against. ``--phase-end swarm`` runs diloco that way
anyway (samples then equal only on average). All peers wait for each other before the first step
(``training.wait_for_peers``), validation runs once, after the last step (``training.validation_every`` =
max_steps: it is not compute), and state averaging is off (``training.state_averaging_every=0``: it repairs
peers that missed rounds, and 3x the model in fp32 would dominate the bytes), and with it the joining of a
peer behind (``training.sync_state_on_join=false``), which loads only a state the swarm averaged.

Per peer, the measured window runs from its first compute to the moment it reached the sample budget: its
status's ``wall_seconds`` (seconds since its first forward pass) and ``compute_seconds`` (forward, backward,
inner optimizer steps) in the first status that shows ``step`` = max_steps and as many rounds (ok or solo) as
steps, i.e. the last update applied (with overlap, the last phase's round lands after its compute: the window
pays for that one round un-overlapped). Statuses are read every ``--poll`` seconds, so a window is at most that
much too long. Start-up (p2pd, DHT, loading the task, waiting for the others) is before the first compute and
not in the window.

Columns: utilisation = compute_seconds / window, mean and min over peers; s/micro-batch = compute seconds per
micro-batch (4 peers share 2 cores: rows are comparable only at similar load); bytes sent per sample = the
peers' summed ``bytes_sent`` (averaging payload) / the samples all peers computed; all traffic = every kind in
``traffic`` (state sync, state averaging too); final validation loss = mean over peers (spread after +-);
rounds ok/solo = min-max over peers of ``rounds_ok``, and the sum of ``rounds_solo``; round s = mean
duration of an averaging round (``round_durations``: matchmaking excluded); window = the longest peer's;
row wall = from starting the first daemon to the last peer's budget, start-up included.

Run (as root: the lab needs network namespaces). Final length, 1200 sequences per peer (300 sync steps, 3
phases of H=100, so ~100x fewer rounds per sample), at 100 and at 25 Mbit/s:

    .venv/bin/python benchmarks/bench_utilisation.py
    .venv/bin/python benchmarks/bench_utilisation.py --rate 25

    options: --samples 1200 --inner-steps 100 --modes sync,diloco-nooverlap,diloco-overlap --peers 4
             --rate 100 --config configs/lm-wan.yaml --phase-end lockstep|swarm --sync-micro-batches 1
             -o KEY=VALUE (any peerd option, every peer, every row) --poll 0.25 --timeout S --keep-logs
    smoke (~2.5 min): --samples 80 --inner-steps 10 -o training.task.options.n_layers=2
                      -o training.task.options.d_model=256 -o training.task.options.d_ff=1024

At the load of the runs below (6-11 on 2 cores) a sync step took 8.4 s at 100 Mbit/s and 21 s at 25, a diloco
micro-batch 2.6-3.3 s: the final length takes ~70 minutes at 100 Mbit/s and ~2.5 hours at 25 (sync ~42 and
~105 of them); quieter machines are faster.

Modest-length runs, 2026-11-24, this 2-core machine, other engineers' tests running (load averages printed):

    --samples 400 --inner-steps 50 (100 Mbit/s, probe 95.2 Mbit/s; load 6.2-11.0 during the rows)
    mode              steps  utilisation mean  min    s/micro-batch  bytes sent/sample  final val loss  rounds ok/solo
    sync              100    20.0%             19.8%  1.679          7329.8 kB          3.0170          100-100 / 0
    diloco-nooverlap  2      94.8%             94.0%  2.789          146.6 kB           3.1642          2-2 / 0
    diloco-overlap    2      96.0%             93.8%  2.650          146.6 kB           3.1614          2-2 / 0
    (windows 841 / 294 / 276 s)

    --rate 25 --samples 200 --inner-steps 25 (probe 23.8 Mbit/s; load 2.9-9.7)
    sync              50     10.3%             9.9%   2.124          7329.8 kB          3.1698          50-50 / 0
    diloco-nooverlap  2      82.4%             80.8%  3.340          293.2 kB           3.2492          2-2 / 0
    diloco-overlap    2      88.3%             87.6%  2.624          293.2 kB           3.3346          2-2 / 0
    (rounds 14.6 / 13.0 / 12.8 s; windows 1028 / 203 / 149 s)

Bytes per sample fall by H (one round of the model per H micro-batches instead of per one). With only 2 phases
the overlap row's last round (of 2) is not overlapped; at H=25 and 25 Mbit/s that round is ~9% of its window.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _netns_peerd import NetnsPeer
from netns import NetnsLab, NetnsUnavailable

from peerd.errors import PeerdError
from peerd.tables import format_table

ROOT = HERE.parent
MODES = {
    "sync": ["-o", "training.mode=sync"],
    "diloco-nooverlap": ["-o", "training.mode=diloco", "-o", "training.diloco.overlap=false"],
    "diloco-overlap": ["-o", "training.mode=diloco", "-o", "training.diloco.overlap=true"],
}
# the same with top-k pseudo-gradients (averaging.codec.scheme=topk at its default density and value width)
MODES.update({f"{mode}-topk": [*MODES[mode], "-o", "averaging.codec.scheme=topk"] for mode in list(MODES)[1:]})
PORT = 31337


@dataclass
class PeerResult:
    end: dict[str, Any] | None = None  # the first status at the sample budget
    final: dict[str, Any] | None = None  # the last status, after the final validation


@dataclass
class Row:
    mode: str
    steps: int
    samples: int  # per peer
    micro_batches: int  # per peer
    peers: list[PeerResult] = field(default_factory=list)
    wall: float = 0.0
    load_before: str = ""
    load_after: str = ""
    error: str | None = None
    log_dir: str = ""


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def effective_config(config: Path, overrides: list[str]) -> dict[str, Any]:
    """The config every peer of a row will run with (`peerd config show` validates it, too)."""
    proc = subprocess.run([sys.executable, "-m", "peerd", "config", "show", "--config", str(config), *overrides],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"invalid configuration for {shlex.join(overrides)}:\n{proc.stderr.strip()}")
    data = yaml.safe_load(proc.stdout)
    assert isinstance(data, dict)
    return data


def reached(status: dict[str, Any], steps: int) -> bool:
    """At the budget with every update applied: one round, ok or solo, per step. ``step`` alone is not
    enough in diloco mode: it counts a phase as soon as its round starts (without overlap too), and with
    overlap ``outer_pending`` stays set after the last round landed (nothing lands it once training stops).
    A peer that loaded a state skipped rounds: for it, idle at the budget."""
    training = status.get("training") or {}
    if int(training.get("step") or 0) < steps:
        return False
    if training["rounds_ok"] + training["rounds_solo"] >= steps:
        return True
    return bool(training.get("state_syncs")) and training.get("state") == "idle"


def run_row(lab: NetnsLab, mode: str, args: argparse.Namespace, index: int) -> Row:
    common = [*MODES[mode], *args.override]
    batch_size = int(effective_config(args.config, common)["training"]["task"]["options"].get("batch_size", 16))
    if mode == "sync":
        per_step = args.sync_micro_batches * batch_size
        budget = ["-o", f"training.samples_per_step={per_step}"]
    else:
        per_step = args.inner_steps * batch_size
        budget = ["-o", f"training.diloco.inner_steps={args.inner_steps}",
                  "-o", f"training.diloco.phase_end={args.phase_end}"]
    if args.samples % per_step:
        raise SystemExit(f"--samples {args.samples} is not a whole number of {mode} steps of {per_step} "
                         f"sequences per peer: use a multiple of {per_step}")
    steps = args.samples // per_step
    row = Row(mode, steps, args.samples, args.samples // batch_size)
    overrides = [*common, *budget, "-o", f"training.max_steps={steps}", "-o", f"training.validation_every={steps}",
                 "-o", f"training.wait_for_peers={args.peers}", "-o", "training.state_averaging_every=0",
                 "-o", "training.sync_state_on_join=false"]
    effective_config(args.config, overrides)  # fail here, not in four daemons
    log_dir = Path(tempfile.mkdtemp(prefix=f"peerdbench-util-{mode}-"))
    row.log_dir = str(log_dir)
    port = PORT + index  # a fresh port per row: the previous row's sockets may linger in TIME_WAIT
    timeout = args.timeout or (600 + steps * (12 if mode == "sync" else 6 * args.inner_steps + 60))
    row.load_before = load()
    print(f"\n== {mode}: {steps} {'global steps' if mode == 'sync' else 'phases'} of {per_step} sequences per "
          f"peer ({args.samples} per peer, {row.micro_batches} micro-batches of {batch_size}); load average "
          f"before {row.load_before}; logs in {log_dir}", flush=True)
    peers: list[NetnsPeer] = []
    started = time.monotonic()
    try:
        for i in range(args.peers):
            peer_args = ["--config", str(args.config), "--run-name", f"util-{mode}", "--control-port", "0",
                         "--host-maddrs", f"/ip4/{lab.addr(i)}/tcp/{port}", *overrides,
                         "-o", f"training.task.shard_index={i}"]
            if i:
                peer_args += ["--initial-peers", peers[0].ready["maddrs"][0]]
            peers.append(NetnsPeer(f"peer{i}", lab.ns(i), peer_args, log_dir))
            if i == 0:
                peers[0].wait_ready(120)
        for peer in peers:
            peer.wait_ready(120)
        row.peers = [PeerResult() for _ in peers]
        deadline = started + timeout
        last_print = time.monotonic()
        while True:
            statuses = [_status(p) for p in peers]
            for result, status in zip(row.peers, statuses, strict=True):
                if status and result.end is None and reached(status, steps):
                    result.end = status
            if all(r.end is not None for r in row.peers) and row.wall == 0.0:
                row.wall = time.monotonic() - started
            done = row.wall and all(_validated(s, steps) for s in statuses)
            if done:
                row.peers = [PeerResult(r.end, s) for r, s in zip(row.peers, statuses, strict=True)]
                break
            for peer in peers:
                if peer.proc.poll() is not None:
                    raise PeerdError(f"{peer.name} exited with code {peer.proc.returncode}:\n{peer.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{mode}: not every peer reached step {steps} and validated it within "
                                   f"{timeout:.0f}s (--timeout)")
            if time.monotonic() - last_print >= 30:
                last_print = time.monotonic()
                print(f"   {last_print - started:5.0f}s  " + "  ".join(_progress(s) for s in statuses), flush=True)
            time.sleep(args.poll)
    except (PeerdError, TimeoutError) as e:
        row.error = str(e)
        print(f"   FAILED: {e}", flush=True)
    finally:
        for peer in peers:
            peer.send(signal.SIGTERM)
        for peer in peers:
            peer.stop()
        orphans = [o for p in peers for o in p.orphans]
        if orphans:
            print(f"   processes left behind a clean stop (killed): {orphans}", flush=True)
    row.load_after = load()
    print(f"   done in {time.monotonic() - started:.0f}s; load average after {row.load_after}", flush=True)
    if row.error is None and not args.keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    return row


def _status(peer: NetnsPeer) -> dict[str, Any] | None:
    try:
        return peer.status(timeout=5.0)
    except PeerdError:
        return None


def _validated(status: dict[str, Any] | None, steps: int) -> bool:
    """The final validation is done: 'idle' comes after it (a diloco peer may validate at the last phase's end
    and again once its round landed)."""
    training = (status or {}).get("training") or {}
    return training.get("validation_step") == steps and training.get("state") == "idle"


def _progress(status: dict[str, Any] | None) -> str:
    training = (status or {}).get("training") or {}
    if not training:
        return "?"
    util = training.get("utilisation")
    inner = f"+{training['inner_steps']}" if training.get("mode") == "diloco" else ""
    return f"{training.get('step')}{inner} ({util * 100:.0f}%)" if util is not None else f"{training.get('step')}"


def summarise(row: Row) -> list[str]:
    if row.error is not None or not row.peers:
        return [row.mode, str(row.steps), "FAILED"] + ["-"] * 9
    ends = [r.end["training"] for r in row.peers if r.end]
    finals = [r.final["training"] for r in row.peers if r.final]
    utils = [t["compute_seconds"] / t["wall_seconds"] for t in ends if t["wall_seconds"] > 0]
    total_samples = row.samples * len(ends)
    sent = sum(t["bytes_sent"] for t in ends)
    traffic = sum(entry["sent"] for t in ends for entry in t["traffic"].values())
    losses = [t["validation_loss"] for t in finals if t.get("validation_loss") is not None]
    ok = [t["rounds_ok"] for t in ends]
    rounds = sum(sum(t["round_durations"]["counts"]) for t in ends)
    round_s = sum(t["round_durations"]["sum"] for t in ends) / rounds if rounds else None
    return [
        row.mode, str(row.steps),
        f"{statistics.mean(utils) * 100:.1f}%", f"{min(utils) * 100:.1f}%",
        f"{statistics.mean(t['compute_seconds'] for t in ends) / row.micro_batches:.3f}",
        f"{sent / total_samples / 1e3:.1f} kB", f"{traffic / total_samples / 1e3:.1f} kB",
        (f"{statistics.mean(losses):.4f} +-{(max(losses) - min(losses)) / 2:.4f}" if losses else "-"),
        f"{min(ok)}-{max(ok)} / {sum(t['rounds_solo'] for t in ends)}",
        f"{round_s:.2f}" if round_s is not None else "-",
        f"{max(t['wall_seconds'] for t in ends):.0f}", f"{row.wall:.0f}",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=100.0, help="each peer's link, Mbit/s both ways")
    parser.add_argument("--samples", type=int, default=1200, help="sequences each peer computes, in every mode")
    parser.add_argument("--inner-steps", type=int, default=100, help="diloco: H, inner steps per phase")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "lm-wan.yaml")
    parser.add_argument("--phase-end", choices=("lockstep", "swarm"), default="lockstep",
                        help="diloco: lockstep (equal samples on every peer) or swarm (equal on average)")
    parser.add_argument("--sync-micro-batches", type=int, default=1,
                        help="sync: micro-batches each peer adds to a global step (training.samples_per_step)")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a peerd option for every peer of every row, e.g. -o training.task.options.n_layers=2")
    parser.add_argument("--poll", type=float, default=0.25, help="seconds between status reads")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per row (default from its length)")
    parser.add_argument("--keep-logs", action="store_true", help="keep daemon logs (always kept on failure)")
    args = parser.parse_args()
    args.override = [arg for item in args.override for arg in ("-o", item)]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; known: {list(MODES)}")

    print(f"{datetime.now().astimezone():%Y-%m-%d %H:%M:%S %Z}  {shlex.join([sys.executable, *sys.argv])}")
    print(f"{args.peers} peers of {args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config}"
          f", {args.samples} sequences per peer per mode, {os.cpu_count()} CPU cores; load average {load()}",
          flush=True)
    rows: list[Row] = []
    try:
        with NetnsLab(args.peers, rate_mbit=args.rate) as lab:
            probe = lab.probe_throughput(0, 1, seconds=5.0)
            print(f"{lab.describe()}\nraw TCP probe p0 -> p1: {probe['mbit']:.1f} Mbit/s", flush=True)
            for index, mode in enumerate(modes):
                rows.append(run_row(lab, mode, args, index))
    except NetnsUnavailable as e:
        print(f"skipped: {e}")
        return 1

    print(f"\n{datetime.now().astimezone():%Y-%m-%d %H:%M:%S %Z}; {args.peers} peers at {args.rate:g} Mbit/s, "
          f"{args.samples} sequences per peer per mode; load average before / after each row:")
    for row in rows:
        print(f"  {row.mode}: {row.load_before} / {row.load_after}" + (f"  (logs: {row.log_dir})" if row.error else ""))
    table = [summarise(r) for r in rows]
    print(format_table(["mode", "steps", "utilisation mean", "min", "compute s/micro-batch", "bytes sent/sample",
                        "all traffic/sample", "final val loss", "rounds ok (min-max) / solo", "round s", "window s",
                        "row wall s"], table))
    for row in rows:
        losses = [r.final["training"]["validation_loss"] for r in row.peers if r.final]
        if len(losses) > 1 and max(losses) - min(losses) > 1e-6:
            print(f"  ! {row.mode}: the peers validated different models (losses {min(losses):.4f}..{max(losses):.4f}):"
                  " with overlap a peer validates at max_steps before the last round has landed")
    return 0 if all(r.error is None for r in rows) else 1


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt("SIGTERM")  # unwind through every finally: daemons stopped, namespaces removed


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _sigterm)
    sys.exit(main())
