"""Side-by-side all-reduce benchmark: one round of averaging a 16M-element fp32 tensor (64 MB) across 2 and 4 peers.

Usage (root is needed for the shaped environment; without it that environment prints 'skipped: <reason>'):

    .venv/bin/python benchmarks/bench_allreduce.py            # full: 16M elements, 5 reps loopback, 3 reps shaped
    .venv/bin/python benchmarks/bench_allreduce.py --quick    # smoke: 4M elements, 2 reps each
    options: --numel N --peers 2,4 --backends gloo,hivemind --envs loopback,netns --reps-loopback 5
             --reps-netns 3 --warmup 1 --rate-mbit 100 --json out.json --keep-logs
             --baseline REV: also run any peerd backend of another git revision, named BACKEND@base (e.g.
             --baseline e3d793e --backends peerd@base,peerd,peerd@base,peerd: the all-reduce before and with
             verified reductions, alternated in one run); a backend listed twice runs twice, and a table
             compares every X with X@base over all their repetitions (time, CPU, bytes)

Every peer is a separate OS process (benchmarks/_allreduce_workers.py, launched with subprocess, in the netns
environment through ``ip netns exec``); each prints one JSON line with per-repetition monotonic start/end stamps,
the bytes its interface sent, and its error against the exact mean. A repetition's time is
max(end over peers) - min(start over peers); peers start each repetition together behind a file barrier.
Medians/minimums are over the non-warm-up repetitions that succeeded on every peer.

Environments:
  loopback -- all peers in the root namespace on 127.0.0.1; no shaping; the 2 cores are shared by all peers
              (and by hivemind's p2pd daemons), so this mostly measures CPU/copy/serialisation cost.
  netns    -- benchmarks/netns.py: one namespace per peer on a bridge in a switch namespace, 10.77.0.x/24,
              tbf 100 Mbit/s on each peer's egress *and* ingress (full-duplex 100 Mbit port per peer).
              A raw TCP probe between two namespaces measures the line rate first.

Backends (add one by writing a worker in _allreduce_workers.py and registering it in BACKENDS there):
  gloo     -- torch.distributed all_reduce(SUM)/n, TCP store on peer 0 (ring all-reduce).
  tcp      -- a reference, not an all-reduce: plain TCP sockets, one connection per pair of peers carrying both
              directions (as p2pd's), each peer sending peerd's payload/peer split evenly over its n-1 partners,
              all at once, with no codec, framing, encryption or data dependency. It is the floor for the peerd
              row: what TCP itself needs to move the same bytes in the same pattern on this network.
  p2pd     -- the tcp row's bytes and pattern through hivemind's P2P binary streams (p2pd: TCP + TLS + yamux,
              plus the Unix-socket hop), two streams per ordered pair as peerd has, no codec or data dependency:
              the floor for peerd *over its transport*. tcp vs p2pd = what the transport costs; p2pd vs peerd =
              what peerd's algorithm (codec, chunking, waiting for every member's chunk) costs.
  peerd_secret -- the peerd row in a private swarm: every stream starts with the membership handshake (two
              round trips, HMAC proofs both ways). peerd_secret / peerd = what membership costs a round.
  peerd_mean -- the peerd row with averaging.aggregation=mean (streaming weighted sum) instead of the robust
              default centered_clip (every member's chunk kept, then combined). peerd / peerd_mean = what the
              robust rule costs a round.
  hivemind -- hivemind 1.1.12 DecentralizedAverager, NoCompression, group of exactly n. Three rows:
              'allreduce' = time inside the averager process's _aggregate_with_group (the butterfly all-reduce
              itself, matchmaking excluded), 'step' = the whole averager.step() (matchmaking included),
              'matchmaking' = barrier -> start of the all-reduce on each peer (the span is from the first peer
              released by the barrier to the last one entering the all-reduce).

Columns: median/min s; algbw = fp32 tensor bytes / median time; payload/peer = bytes each peer must send by the
algorithm (2(n-1)/n x tensor for ring and butterfly); wire tx/peer = bytes actually sent by each peer's interface
over the whole repetition window (barrier to return, so for hivemind the whole step incl. matchmaking), mean over
peers, median over reps (netns only -- loopback's counter is shared; TCP/IP headers, ACKs, framing, TLS and
hivemind's DHT chatter included); payload Mbit/s = payload/peer x 8 / median, with '% of line' relative to the
measured raw TCP line rate (payload, so both sides exclude headers); x gloo = median / gloo median for the same n;
cpu s/peer = CPU seconds (user+system) a peer's worker process and its descendants (p2pd, hivemind's
DHT/averager processes) used from the repetition's barrier until it had the result, mean over peers, median
over reps: with all peers sharing 2 cores, n x this over the wall time says how CPU-bound a row is;
max|err| = largest |result - exact mean| over peers and reps. Numbers are printed, never asserted; a repetition
whose result is wrong on any peer is reported under the table and left out of the timings.

What limits the netns numbers (measured on this 2-core machine, Nov 2026; docs/benchmarks.md, "All-reduce", has the runs):
  * n-1 partners at once, both directions: plain TCP in peerd's pattern reaches 88-92% of the one-way probe at
    n=4 (95-96% at n=2): ACKs share each uplink and n-1 flows share each port both ways.
  * p2pd: the p2pd row, with no codec and no data dependency, reaches 72-87% at n=4 (67-94% at n=2), at 25,
    50 and 100 Mbit/s alike, so neither CPU (at 25 Mbit/s the 4 peers together keep the 2 cores ~15% busy)
    nor a fixed window per round trip explains it. Its goroutine dumps (-pprof) show the copies into yamux
    streams waiting for yamux send window while the tbf queues are short; yamux's 256 KiB stream window does
    not auto-tune here (its RTT sample is taken on the idle link), and hivemind's p2pd build has no setting
    for it. Also tried: 1, 2, 4 or 8 streams per pair; one partner after the other.
  * --transport quic (libp2p's QUIC in the same p2pd, its own flow control): at n=4 peerd reaches 88-96% at 25
    Mbit/s and 90% at 50, but costs ~0.3-0.4 core per busy peer, so at 100 Mbit/s the 4 peers saturate the 2
    cores (64-75%).
  * peerd sits in the p2pd row's band at n=4 (77-85% in the same runs; above it at n=2), so its own algorithm
    costs little over its transport; the 90% target at n=4 is above what either transport delivers here.
  * CPU: packet processing of the emulated switch (veth, bridge, both tbf queues) runs in softirq context and
    is charged to the peers' processes, so "cpu s/peer" is ~4x the loopback figure for the same bytes, and
    other load on the machine shows up in the netns rows: compare reruns, not single numbers.

Load: loopback numbers are CPU-bound on 2 cores, so the load average is printed before/after each environment.
hivemind notes: averager.step() in 1.1.12 can return successfully with part of the vector *not* averaged (a failed
part is logged as "Averaging: received 99.2% results" and left at the local value) -- the correctness check catches
that, it is rare (seen once in ~60 loopback rounds of 4 peers under heavy machine load).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _allreduce_workers import BACKENDS
from netns import NetnsLab, NetnsUnavailable

WORKER = HERE / "_allreduce_workers.py"

try:
    from peerd.tables import format_table
except ImportError:  # keep the benchmark usable on its own
    def format_table(headers, rows):
        cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


@dataclass
class Env:
    name: str
    addrs: list[str]  # address of peer i
    prefixes: list[list[str]]  # command prefix of peer i (e.g. ip netns exec ...)
    iface: str | None  # interface whose tx counter is per peer (None on the shared loopback)
    reps: int
    rate_mbit: float | None = None  # nominal shaping
    line_mbit: float | None = None  # measured raw TCP throughput
    note: str = ""


@dataclass
class GroupResult:
    env: str
    backend: str
    n: int
    numel: int
    times: dict[str, list[float]] = field(default_factory=dict)  # metric -> per good rep seconds
    tx_bytes: list[float] = field(default_factory=list)  # mean over peers, per good rep
    cpu_s: list[float] = field(default_factory=list)  # CPU seconds per peer (mean over peers), per good rep
    max_err: float = 0.0
    rel_err: float = 0.0
    good_reps: int = 0
    total_reps: int = 0
    errors: list[str] = field(default_factory=list)
    wall: float = 0.0
    payload_sent: float | None = None  # bytes a peer's all-reduce reported sending in a round (peerd), mean


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """Stop a worker and everything it forked (hivemind's DHT/averager children and p2pd share its group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:  # the leader may be gone while its children (p2pd, ...) still run in the group
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def run_group(env: Env, backend: str, n: int, numel: int, warmup: int, timeout: float, logdir: Path,
              transport: str = "tcp") -> GroupResult:
    res = GroupResult(env.name, backend, n, numel, total_reps=env.reps)
    rdv = Path(tempfile.mkdtemp(prefix="rdv-", dir=logdir))
    port = free_port()  # free in the root namespace; the lab namespaces are fresh, so free there too
    addrs = ",".join(env.addrs[:n])
    procs: list[subprocess.Popen] = []
    started = time.monotonic()
    outputs: list[str | None] = [None] * n
    try:
        for rank in range(n):
            cmd = env.prefixes[rank] + [
                sys.executable, str(WORKER), "--backend", backend, "--rank", str(rank), "--n", str(n),
                "--addrs", addrs, "--numel", str(numel), "--reps", str(env.reps), "--warmup", str(warmup),
                "--rdv", str(rdv), "--port", str(port), "--transport", transport,
            ] + (["--iface", env.iface] if env.iface else [])
            child_env = dict(os.environ, GLOO_SOCKET_IFNAME=env.iface or "lo", PYTHONUNBUFFERED="1",
                             BENCH_HARNESS_PID=str(os.getpid()))
            if backend.endswith("@base"):
                assert BASELINE_TREE is not None
                child_env["PEERD_BENCH_TREE"] = str(BASELINE_TREE)
            with open(logdir / f"{env.name}-{backend}-n{n}-rank{rank}-{os.path.basename(rdv)}.log", "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=child_env,
                                              start_new_session=True))
        deadline = started + timeout
        for rank, proc in enumerate(procs):
            try:
                outputs[rank], _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                res.errors.append(f"rank {rank}: timed out after {timeout:.0f}s")
                break
    finally:
        for proc in procs:
            _kill_group(proc)
    res.wall = time.monotonic() - started

    per_rank = []
    for rank, out in enumerate(outputs):
        line = next((x for x in (out or "").splitlines() if x.startswith("BENCH_RESULT ")), None)
        if line is None:
            res.errors.append(f"rank {rank}: no result (see {logdir}/{env.name}-{backend}-n{n}-rank{rank}.log)")
            per_rank.append(None)
            continue
        data = json.loads(line[len("BENCH_RESULT "):])
        if data.get("error"):
            res.errors.append(f"rank {rank}: {data['error']}")
        per_rank.append(data)
    if any(d is None for d in per_rank):
        return res

    spec = BACKENDS[backend.split("@")[0]]
    n_recs = min(len(d.get("records", [])) for d in per_rank)
    for i in range(n_recs):
        recs = [d["records"][i] for d in per_rank]
        if recs[0]["warmup"]:
            continue
        errs = [r["error"] for r in recs if r.get("error")]
        if errs:
            res.errors.append(f"rep {i}: {errs[0]}")
            continue
        if any("max_abs_err" not in r for r in recs):
            res.errors.append(f"rep {i}: result not checked on every peer")
            continue
        max_err = max(r["max_abs_err"] for r in recs)
        res.max_err = max(res.max_err, max_err)
        res.rel_err = max(res.rel_err, max(r["rel_l2_err"] for r in recs))
        if max_err > spec.tolerance:
            bad = max(r.get("bad_frac", 0.0) for r in recs)
            res.errors.append(f"rep {i}: WRONG RESULT on rank(s) "
                              f"{[k for k, r in enumerate(recs) if r['max_abs_err'] > spec.tolerance]}: "
                              f"max |err| {max_err:.3g} > {spec.tolerance:g} on {100 * bad:.2f}% of the elements")
            continue
        spans = {}
        for metric in spec.metrics:
            stamps = [r["metrics"].get(metric) for r in recs]
            if all(s is not None for s in stamps):
                spans[metric] = max(e for _, e in stamps) - min(s for s, _ in stamps)
        if "allreduce" not in spans:
            res.errors.append(f"rep {i}: no all-reduce timing on every peer")
            continue
        for metric, seconds in spans.items():
            res.times.setdefault(metric, []).append(seconds)
        if all("tx_bytes" in r for r in recs):
            res.tx_bytes.append(statistics.mean(r["tx_bytes"] for r in recs))
        if all("cpu_s" in r for r in recs):
            res.cpu_s.append(statistics.mean(r["cpu_s"] for r in recs))
        res.good_reps += 1
    sent = [d.get("extra", {}).get("payload_bytes_sent") for d in per_rank]
    if all(isinstance(b, (int, float)) for b in sent):
        res.payload_sent = statistics.mean(sent)
    return res


def _load() -> str:
    """Other work on the machine skews the CPU-bound loopback numbers: print it next to them."""
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg()) + f" ({os.cpu_count()} cores)"
    except OSError:
        return "n/a"


def fmt_bytes(b: float | None) -> str:
    return "-" if b is None else f"{b / 1e6:.1f} MB"


def print_table(env: Env, results: list[GroupResult]) -> None:
    gloo = {r.n: statistics.median(r.times["allreduce"]) for r in results
            if r.backend == "gloo" and r.times.get("allreduce")}
    rows = []
    for r in results:
        spec = BACKENDS[r.backend.split("@")[0]]
        tensor_bytes = r.numel * 4
        payload = spec.payload_bytes(r.numel, r.n)
        metrics = [m for m in spec.metrics if r.times.get(m)] or ["allreduce"]
        for metric in metrics:
            ts = r.times.get(metric) or []
            label = r.backend if metric == "allreduce" and len(spec.metrics) == 1 else f"{r.backend} ({metric})"
            if not ts:
                rows.append([label, r.n, f"0/{r.total_reps}"] + ["-"] * 9
                            + [f"{r.max_err:.1e}" if r.max_err else "-", "FAILED"])
                continue
            med, low = statistics.median(ts), min(ts)
            is_transfer = metric != "matchmaking"
            payload_mbit = payload * 8 / med / 1e6 if payload and is_transfer else None
            ratio = med / gloo[r.n] if r.n in gloo and is_transfer else None
            rows.append([
                label, r.n, f"{r.good_reps}/{r.total_reps}", f"{med:.3f}", f"{low:.3f}",
                f"{tensor_bytes / med / 1e6:.1f}" if is_transfer else "-",
                fmt_bytes(payload) if is_transfer else "-",
                fmt_bytes(statistics.median(r.tx_bytes)) if r.tx_bytes and metric == "allreduce" else "-",
                f"{payload_mbit:.1f}" if payload_mbit is not None else "-",
                f"{100 * payload_mbit / env.line_mbit:.0f}%" if payload_mbit is not None and env.line_mbit else "-",
                f"{ratio:.2f}x" if ratio is not None else "-",
                f"{statistics.median(r.cpu_s):.2f}" if r.cpu_s and metric == "allreduce" else "-",
                "-" if spec.reference else f"{r.max_err:.1e}" if metric == "allreduce" else "",
                "ok" if not r.errors else f"{len(r.errors)} issue(s)",
            ])
    headers = ["backend", "peers", "reps ok", "median s", "min s", "algbw MB/s", "payload/peer", "wire tx/peer",
               "payload Mbit/s", "% of line", "x gloo", "cpu s/peer", "max|err|", "status"]
    print(format_table(headers, rows))
    for r in results:
        for err in r.errors[:5]:
            print(f"  ! {r.backend} n={r.n}: {err}")


BASELINE_TREE: Path | None = None


def export_revision(revision: str, into: Path) -> Path:
    """The peerd package of git ``revision`` of this repository in ``into``, protocols compiled."""
    from grpc_tools import protoc

    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(HERE.parent), "archive", revision, "peerd", "protocols"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    out = into / "peerd" / "proto"
    out.mkdir(exist_ok=True)
    sources = sorted(str(p) for p in (into / "protocols").glob("*.proto"))
    if protoc.main(["grpc_tools.protoc", f"-I{into / 'protocols'}", f"--python_out={out}", *sources]) != 0:
        raise RuntimeError(f"protoc failed on the protocols of {revision}")
    (out / "__init__.py").write_text("")
    _build_kernel(into)
    rev = subprocess.run(["git", "-C", str(HERE.parent), "rev-parse", "--short", revision], check=True,
                         capture_output=True, text=True).stdout.strip()
    print(f"baseline: peerd at {rev} in {into}", flush=True)
    return into


def _build_kernel(tree: Path) -> None:
    """The codec's C kernel of an exported revision, built as setup.py builds it (a revision without it encodes
    with torch, several times slower: a baseline without its kernel would make every other revision look fast)."""
    import sysconfig

    source = tree / "peerd" / "wire" / "_blockwise.c"
    if not source.exists():
        return
    target = source.with_name("_blockwise" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([sysconfig.get_config_var("CC").split()[0], "-O3", "-pthread", "-shared", "-fPIC",
                    f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(target)], check=True)


def print_baseline_comparison(results: list[GroupResult]) -> None:
    """Every backend X that ran beside X@base: medians over all their repetitions (a backend listed several
    times pools its runs), the ratio of round times, and what each peer spent and sent more per round."""
    pooled: dict[tuple[str, int], GroupResult] = {}
    for r in results:
        key = (r.backend, r.n)
        into = pooled.setdefault(key, GroupResult(r.env, r.backend, r.n, r.numel))
        for metric, ts in r.times.items():
            into.times.setdefault(metric, []).extend(ts)
        into.cpu_s.extend(r.cpu_s)
        into.tx_bytes.extend(r.tx_bytes)
        into.payload_sent = r.payload_sent or into.payload_sent
    rows = []
    for (backend, n), base in sorted(pooled.items()):
        if not backend.endswith("@base") or (backend[: -len("@base")], n) not in pooled:
            continue
        new = pooled[(backend[: -len("@base")], n)]
        if not new.times.get("allreduce") or not base.times.get("allreduce"):
            continue
        t_new, t_base = statistics.median(new.times["allreduce"]), statistics.median(base.times["allreduce"])
        c_new = statistics.median(new.cpu_s) if new.cpu_s else float("nan")
        c_base = statistics.median(base.cpu_s) if base.cpu_s else float("nan")
        sent_new, sent_base = new.payload_sent, base.payload_sent
        extra = f"{(sent_new - sent_base) / 1e3:+.1f} KB ({(sent_new / sent_base - 1) * 100:+.2f}%)" \
            if sent_new and sent_base else "-"
        rows.append([new.backend, n, f"{len(base.times['allreduce'])}/{len(new.times['allreduce'])}",
                     f"{t_base:.3f}", f"{t_new:.3f}", f"{(t_new / t_base - 1) * 100:+.1f}%",
                     f"{c_base:.3f}", f"{c_new:.3f}", f"{(c_new - c_base) * 1000:+.0f} ms", extra])
    if rows:
        print("\nthis revision against the baseline (pooled repetitions; bytes: what one peer's all-reduce sent)")
        print(format_table(["backend", "n", "reps base/new", "base s", "new s", "time", "base cpu s/peer",
                            "new cpu s/peer", "cpu/peer", "bytes sent/peer"], rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=None, help="fp32 elements (default 16M, --quick 4M)")
    parser.add_argument("--peers", default="2,4")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--envs", default="loopback,netns")
    parser.add_argument("--reps-loopback", type=int, default=None, help="default 5 (--quick 2)")
    parser.add_argument("--reps-netns", type=int, default=None, help="default 3 (--quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="discarded repetitions before the measured ones")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--transport", choices=("tcp", "quic"), default="tcp",
                        help="libp2p transport of peerd, p2pd and hivemind (p2pd's /tcp or /udp/quic-v1)")
    parser.add_argument("--probe-seconds", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 4M elements, 2 repetitions")
    parser.add_argument("--json", type=Path, default=None, help="also write all results here")
    parser.add_argument("--keep-logs", action="store_true", help="keep per-worker logs (always kept on failure)")
    parser.add_argument("--baseline", default=None,
                        help="git revision whose peerd the BACKEND@base backends run (exported to the log dir)")
    args = parser.parse_args()

    numel = args.numel or (4 * 2**20 if args.quick else 16 * 2**20)
    reps_lo = args.reps_loopback or (2 if args.quick else 5)
    reps_ns = args.reps_netns or (2 if args.quick else 3)
    peers = [int(x) for x in args.peers.split(",")]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b.split("@")[0] not in BACKENDS or b.count("@") > 1
               or (b.endswith("@base") and not args.baseline) or ("@" in b and not b.endswith("@base"))]
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; known: {list(BACKENDS)}, and BACKEND@base with --baseline")
    envs = [e.strip() for e in args.envs.split(",")]
    logdir = Path(tempfile.mkdtemp(prefix="peerdbench-allreduce-"))
    global BASELINE_TREE
    if args.baseline:
        BASELINE_TREE = export_revision(args.baseline, logdir / "baseline")

    t_start = time.monotonic()
    print(f"all-reduce of {numel:,} fp32 elements ({numel * 4 / 1e6:.1f} MB), peers {peers}, backends {backends}, "
          f"warm-up {args.warmup}, libp2p over {args.transport}, {os.cpu_count()} CPU cores shared by all peers; "
          f"logs in {logdir}", flush=True)
    all_results: list[GroupResult] = []
    any_failure = False
    envinfo = {}

    def run_env(env: Env) -> None:
        nonlocal any_failure
        print(f"\n== {env.name}: {env.note}\n   load average before: {_load()}", flush=True)
        results = []
        for n in peers:
            for backend in backends:
                per_rep = 60.0 + (4 * numel * 4 * 8 / (env.rate_mbit * 1e6) if env.rate_mbit else 30.0)
                timeout = 120.0 + (env.reps + args.warmup) * per_rep
                r = run_group(env, backend, n, numel, args.warmup, timeout, logdir, args.transport)
                any_failure |= bool(r.errors)
                med = statistics.median(r.times["allreduce"]) if r.times.get("allreduce") else float("nan")
                print(f"   {backend:<10} n={n}: all-reduce median {med:.3f}s over {r.good_reps}/{r.total_reps} reps "
                      f"(group wall {r.wall:.0f}s){'  ISSUES: ' + '; '.join(r.errors[:2]) if r.errors else ''}",
                      flush=True)
                results.append(r)
        print(f"   load average after: {_load()}")
        print(f"\n{env.name} results (repetition time = last peer done - first peer started; medians over reps):")
        print_table(env, results)
        print_baseline_comparison(results)
        all_results.extend(results)
        envinfo[env.name] = {"line_mbit": env.line_mbit, "rate_mbit": env.rate_mbit, "reps": env.reps,
                             "note": env.note}

    for name in envs:
        if name == "loopback":
            run_env(Env("loopback", ["127.0.0.1"] * max(peers), [[] for _ in range(max(peers))], None, reps_lo,
                        note="127.0.0.1 in the root namespace, unshaped"))
        elif name == "netns":
            try:
                with NetnsLab(max(peers), rate_mbit=args.rate_mbit) as lab:
                    probe = lab.probe_throughput(0, 1, seconds=args.probe_seconds)
                    env = Env("netns", [lab.addr(i) for i in range(max(peers))],
                              [lab.exec_prefix(i) for i in range(max(peers))], "eth0", reps_ns,
                              rate_mbit=args.rate_mbit, line_mbit=probe["mbit"],
                              note=f"{lab.describe()}\n   raw TCP probe p0 -> p1 ({probe['seconds']:.1f}s, "
                                   f"{probe['bytes'] / 1e6:.0f} MB): line rate {probe['mbit']:.1f} Mbit/s of TCP "
                                   f"payload ({probe['mbit'] / 8:.1f} MB/s; whole-transfer average "
                                   f"{probe['mbit_whole']:.1f})")
                    run_env(env)
            except NetnsUnavailable as e:
                print(f"\n== netns: skipped: {e}", flush=True)
        else:
            print(f"\n== {name}: skipped: unknown environment (known: loopback, netns)")

    wall = time.monotonic() - t_start
    print(f"\ntotal wall time {wall:.0f}s")
    if args.json:
        args.json.write_text(json.dumps({"numel": numel, "envs": envinfo, "wall": wall,
                                         "results": [r.__dict__ for r in all_results]}, indent=1))
    if not any_failure and not args.keep_logs:
        for f in sorted(logdir.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        logdir.rmdir()
    elif any_failure:
        print(f"worker logs kept in {logdir}")
    return 0


def _sigterm(signum, frame):
    raise KeyboardInterrupt("SIGTERM")  # unwind through every finally: workers killed, namespaces removed


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: workers killed, namespaces removed", file=sys.stderr)
        sys.exit(130)
