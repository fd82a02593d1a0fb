"""Many peers on one machine: time to a full view, one DHT or several, DHT read latency, memory, and rounds.

``--peers N`` daemons on loopback (``--peers 16,32,64`` runs each size in turn, ``--runs`` times). The first
``--bootstraps`` start first (peer 0 alone, the others through it); the rest join through all of them, started
``--batch`` at a time side by side (each batch once the previous one printed its ready lines: 64 imports of torch
at once starve two cores past p2pd's start-up timeout). Then every peer's ``peerd status`` is polled until each
lists all the others (or ``--timeout`` after the last ready line), one sweep every ``--poll`` seconds at most.

Printed per run: seconds from the first start to the last ready line; from the last ready line to every peer
listing every other; records seen per peer (min/median, and statuses whose DHT read failed, counted apart); the
number of distinct views and of DHTs (connected groups of the "lists" relation: more than one is a split
brain); peers that flagged a partial view or
re-bootstrapped (``view`` in status); DHT read latency (each daemon times its reads of all records: the median
over peers of their p50, and the median and max of their p99); RSS, PSS and USS of each peer's process tree
(median, max, and PSS summed over all peers); open file descriptors per peer; loopback traffic per peer over
``--idle-window`` seconds once views are full (record refreshes, view checks, DHT upkeep, and this script's
status polls, which read the records too), and the cores all daemons, DHT processes and p2pds used in it; the
machine's load.

``--mode train`` (configs/synthetic.yaml: groups of 4, at least 2): once the views are full the trainers train
for ``--train-seconds``; printed: rounds averaged and solo (success rate), group sizes, steps.

Run: .venv/bin/python benchmarks/bench_scale.py --peers 16,32,64 [--mode light|train] [--runs 5] [-o key=value]
from the checkout being measured: each daemon runs ``python -m peerd``, which imports peerd from the working
directory before anything on PYTHONPATH or installed.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import psutil
from _memory import process_tree, tree_memory

from peerd.errors import PeerdError
from peerd.launcher import LocalSwarm, PeerProcess
from peerd.tables import format_table

CONFIGS = {"light": HERE.parent / "configs" / "local.yaml", "train": HERE.parent / "configs" / "synthetic.yaml"}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def status_of(peer: PeerProcess) -> dict[str, Any] | None:
    try:
        return {**peer.status(timeout=20.0), "fetched_at": time.monotonic()}
    except (PeerdError, OSError):
        return None


def statuses(pool: ThreadPoolExecutor, peers: list[PeerProcess]) -> dict[str, dict[str, Any]]:
    return {peer.peer_id: found for peer, found in zip(peers, pool.map(status_of, peers)) if found is not None}


def launch(swarm: LocalSwarm, args: argparse.Namespace, n: int, pool: ThreadPoolExecutor) -> None:
    base = ["--config", str(args.config), "--control-port", "0"]
    for item in args.override:
        base += ["-o", item]

    def spawn(initial: list[str]) -> PeerProcess:
        peer = PeerProcess(f"peer{len(swarm.peers)}", [*base, *(f"--initial-peers={a}" for a in initial)],
                           swarm.log_dir)
        swarm.peers.append(peer)
        return peer

    spawn([]).wait_ready(120)
    first = swarm.peers[0].ready["maddrs"][0]
    for _ in range(1, min(args.bootstraps, n)):
        spawn([first]).wait_ready(120)
    initial = [p.ready["maddrs"][0] for p in swarm.peers]
    while len(swarm.peers) < n:
        batch = [spawn(initial) for _ in range(min(args.batch, n - len(swarm.peers)))]
        list(pool.map(lambda p: p.wait_ready(240), batch))


def loopback_bytes() -> int:
    """Bytes received on the loopback interface so far (every peer here talks over it, nothing else should)."""
    with open("/proc/net/dev") as dev:
        for line in dev:
            name, _, counters = line.partition(":")
            if name.strip() == "lo":
                return int(counters.split()[0])
    return 0


def training_totals(found: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Rounds (averaged, solo) and group sizes summed over the trainers; steps per trainer."""
    trainers = [s["training"] for s in found.values() if s.get("training")]
    sizes: Counter[str] = Counter()
    for t in trainers:
        sizes.update(t.get("group_sizes") or {})
    return {"rounds_ok": sum(t.get("rounds_ok", 0) for t in trainers),
            "rounds_solo": sum(t.get("rounds_solo", 0) for t in trainers),
            "group_sizes": sizes, "steps": sorted(t.get("step", 0) for t in trainers)}


def cpu_by_kind(peers: list[PeerProcess]) -> Counter[str]:
    """CPU seconds used so far by every peer's daemon, DHT process and p2pd, summed per kind."""
    used: Counter[str] = Counter()
    for peer in peers:
        for pid in process_tree(peer.proc.pid):
            try:
                process = psutil.Process(pid)
                times = process.cpu_times()
                kind = "daemon" if pid == peer.proc.pid else "p2pd" if process.name() == "p2pd" else "DHT"
            except psutil.NoSuchProcess:
                continue
            used[kind] += times.user + times.system
    return used


def dht_groups(views: dict[str, set[str]]) -> list[int]:
    """Sizes of the connected groups of peers, linking two peers when either lists the other."""
    parent = {peer: peer for peer in views}

    def root(peer: str) -> str:
        while parent[peer] != peer:
            parent[peer] = parent[parent[peer]]
            peer = parent[peer]
        return peer

    for peer, seen in views.items():
        for other in seen & views.keys():
            parent[root(peer)] = root(other)
    return sorted(Counter(root(peer) for peer in views).values(), reverse=True)


def run_once(args: argparse.Namespace, n: int, log_dir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"peers": n, "load_start": load()}
    with LocalSwarm(args.config, log_dir=log_dir) as swarm, ThreadPoolExecutor(16) as pool:
        launch(swarm, args, n, pool)
        peers = swarm.peers
        first_start = min(p.started_at for p in peers)
        last_ready = max(p.started_at + (p.ready_after or 0.0) for p in peers)
        result["start_to_last_ready"] = last_ready - first_start
        everyone = {p.peer_id for p in peers}
        full_at: dict[str, float] = {}
        found: dict[str, dict[str, Any]] = {}
        while len(full_at) < n and time.monotonic() - last_ready < args.timeout:
            sweep = time.monotonic()
            found = statuses(pool, [p for p in peers if p.peer_id not in full_at])
            for peer_id, status in found.items():
                if {entry["peer_id"] for entry in status["peers"]} | {peer_id} >= everyone:
                    full_at[peer_id] = status["fetched_at"]
            # Each status reads every record from the DHT, as much work as a view check: sweeping back to back
            # (16 at a time) read as often as the daemons' own checks did and doubled the load being measured.
            time.sleep(max(0.0, args.poll - (time.monotonic() - sweep)))  # polling interval of the sweep
        result["full_view_after_last_ready"] = max(full_at.values()) - last_ready if len(full_at) == n else None
        result["full_views"] = len(full_at)
        found = statuses(pool, peers)
        # a status whose DHT read failed lists nobody: a failed read, not a view of one
        result["read_errors"] = sum(1 for s in found.values() if s.get("dht_error"))
        views = {pid: {e["peer_id"] for e in s["peers"]} | {pid} for pid, s in found.items() if not s.get("dht_error")}
        result["seen"] = sorted(len(v) for v in views.values()) or [0]
        result["distinct_views"] = len({frozenset(v) for v in views.values()})
        # a peer whose read failed is still in the DHT the others' listings put it in
        result["dht_groups"] = dht_groups({pid: {pid} for pid in found} | views)
        view_status = [s.get("view") or {} for s in found.values()]
        result["flagged"] = sum(1 for v in view_status if v.get("partial"))
        result["rebootstraps"] = sum(v.get("rebootstraps", 0) for v in view_status)
        reads = [v["read_seconds"] for v in view_status if (v.get("read_seconds") or {}).get("p50") is not None]
        result["read_p50"] = statistics.median(r["p50"] for r in reads) if reads else None
        result["read_p99"] = (statistics.median(r["p99"] for r in reads), max(r["p99"] for r in reads)) if reads \
            else None
        result["load_full_view"] = load()
        # steady-state traffic: record refreshes, view checks, DHT upkeep (and this script's status polls)
        sent, started, cpu = loopback_bytes(), time.monotonic(), cpu_by_kind(peers)
        time.sleep(args.idle_window)  # the measurement window
        elapsed = time.monotonic() - started
        result["lo_bytes_per_s"] = (loopback_bytes() - sent) / elapsed
        result["cores_by_kind"] = {kind: used / elapsed for kind, used in (cpu_by_kind(peers) - cpu).items()}
        if args.mode == "train":
            before = training_totals(found)  # rounds before the full view include peer 0's alone at start
            time.sleep(args.train_seconds)  # the training window being measured, not synchronisation
            after = training_totals(statuses(pool, peers))
            result.update({key: after[key] - before[key] for key in ("rounds_ok", "rounds_solo")})
            sizes = after["group_sizes"]
            sizes.subtract(before["group_sizes"])
            result["group_sizes"] = {size: count for size, count in sorted(sizes.items(), key=lambda kv: int(kv[0]))
                                     if count}
            result["steps"] = after["steps"]
        memory = [tree_memory(process_tree(p.proc.pid)) for p in peers]
        result["memory"] = memory
        result["fds"] = sorted(len(os.listdir(f"/proc/{p.proc.pid}/fd")) for p in peers if p.proc.poll() is None)
        result["load_end"] = load()
        for peer in peers:  # all at once: one by one, 64 shutdowns take minutes
            peer.send(signal.SIGTERM)
        # stop() with a harmless SIGCONT, not a second SIGTERM: one arriving after the daemon's loop closed
        # kills it (-15 exit codes, seen at 32 peers)
        result["exit_codes"] = Counter(pool.map(lambda p: p.stop(signal.SIGCONT, timeout=60), peers))
    return result


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    rows = []
    for r in results:
        mem = r["memory"]
        full = r["full_view_after_last_ready"]
        p99 = r["read_p99"]
        rows.append([
            str(r["peers"]), f"{r['start_to_last_ready']:.0f}",
            f"{full:.1f}" if full is not None else f"no ({r['full_views']}/{r['peers']})",
            f"{r['seen'][0]}/{statistics.median(r['seen']):g}/{r['read_errors']}", str(r["distinct_views"]),
            "+".join(map(str, r["dht_groups"])), f"{r['flagged']}/{r['rebootstraps']}",
            f"{r['read_p50'] * 1e3:.0f}" if r["read_p50"] is not None else "-",
            f"{p99[0] * 1e3:.0f}/{p99[1] * 1e3:.0f}" if p99 else "-",
            f"{statistics.median(m.rss for m in mem):.0f}/{max(m.rss for m in mem):.0f}",
            f"{statistics.median(m.pss for m in mem):.0f}/{max(m.pss for m in mem):.0f}",
            f"{statistics.median(m.uss for m in mem):.0f}", f"{sum(m.pss for m in mem) / 1024:.1f}",
            f"{r['fds'][len(r['fds']) // 2]}/{r['fds'][-1]}" if r["fds"] else "-",
            f"{r['lo_bytes_per_s'] / r['peers'] / 1024:.1f}",
            " ".join(f"{kind} {r['cores_by_kind'].get(kind, 0.0):.2f}" for kind in ("daemon", "DHT", "p2pd")),
            f"{r['load_start']} | {r['load_full_view']} | {r['load_end']}",
        ])
    print(f"\nbench_scale {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} cores, mode {args.mode}, "
          f"config {args.config.name}, bootstraps {args.bootstraps}, batch {args.batch}, overrides {args.override}")
    print(format_table(["peers", "start->last ready s", "full view after last ready s", "seen min/med/read errors",
                        "views", "DHTs", "flagged/rebootstraps", "read p50 ms", "read p99 med/max ms",
                        "RSS med/max MiB", "PSS med/max MiB", "USS med MiB", "PSS sum GiB", "fds med/max",
                        "lo KiB/s per peer", "cores used (all peers)", "load 1/5/15: start | full view | end"], rows))
    if args.mode == "train":
        train_rows = []
        for r in results:
            ok, solo = r["rounds_ok"], r["rounds_solo"]
            rate = f"{ok / (ok + solo):.0%}" if ok + solo else "-"
            train_rows.append([str(r["peers"]), str(ok), str(solo), rate, str(r["group_sizes"]),
                               f"{r['steps'][0]}/{statistics.median(r['steps']):g}/{r['steps'][-1]}"])
        print(f"\ntraining for {args.train_seconds:g}s after the full view (rounds in that window, counted by each "
              f"member: a round of 4 counts 4 times)")
        print(format_table(["peers", "rounds ok", "rounds solo", "success", "group sizes {size: rounds}",
                            "steps min/med/max"], train_rows))
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="16", help="comma-separated swarm sizes")
    parser.add_argument("--mode", choices=sorted(CONFIGS), default="light")
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--bootstraps", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--train-seconds", type=float, default=90.0)
    parser.add_argument("--poll", type=float, default=5.0, help="seconds between status sweeps (at least)")
    parser.add_argument("--idle-window", type=float, default=20.0, help="seconds of traffic measured")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    args.config = args.config or CONFIGS[args.mode]
    results = []
    for n in (int(size) for size in args.peers.split(",")):
        for run in range(args.runs):
            log_dir = Path(tempfile.mkdtemp(prefix=f"peerd-scale-{n}-{run}-"))
            try:
                results.append(run_once(args, n, log_dir))
            except (PeerdError, TimeoutError) as e:  # a peer that never got ready: say so, go on to the next run
                print(f"{n} peers run {run + 1}: FAILED ({str(e).splitlines()[0]}), logs {log_dir}", flush=True)
                continue
            r = results[-1]
            print(f"{n} peers run {run + 1}: full view {r['full_view_after_last_ready']}, DHTs {r['dht_groups']}, "
                  f"seen min {r['seen'][0]}, exit codes {dict(r['exit_codes'])}, logs {log_dir}", flush=True)
            report(results, args)  # after every run: a long series cut short still leaves its table


if __name__ == "__main__":
    main()
