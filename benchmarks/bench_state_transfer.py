"""Time, bytes and memory of a late joiner's state download (peerd.training.transfer.server / download) between processes
in network namespaces behind a shaped link.

Usage (root is needed for the namespaces; --env loopback runs unshaped on 127.0.0.1 without it):

    .venv/bin/python benchmarks/bench_state_transfer.py                      # 250 MB at 25 Mbit/s, one donor
    .venv/bin/python benchmarks/bench_state_transfer.py --kill-donor         # two donors, the first killed
    options: --size-mb 250 --rate 25 --transport tcp|quic --kill-at 0.4 --env netns|loopback --keep-logs

Every peer is its own OS process (this file with --role donor|joiner, through ``ip netns exec``), with its own
p2pd. A donor builds a state of random tensors (mostly fp32, some bf16, a 0-dim step; --size-mb in total),
serves it with StateServer and prints a READY line with its multiaddrs and the sha256 of each tensor. The
joiner downloads it with StateDownloader into tensors allocated from the template, checks every tensor's
sha256 against the donors', and prints a RESULT line. With --kill-donor two donors serve the same state; once
the joiner holds --kill-at of it, the harness SIGKILLs the first donor's process group (its p2pd included)
and the joiner goes on from the second, resuming at the byte where the first stopped.

Columns: size; rate (the tbf rate of every port, benchmarks/netns.py); seconds = the joiner's download() from
first request to checked state; achieved Mbit/s = state bytes x 8 / seconds (payload only: framing, TLS, TCP/IP
and the manifest are overhead); from donor i = payload bytes the joiner got from donor i (and, on netns, bytes
donor i's interface sent, all overhead included); peak RSS = the process's peak resident set (ru_maxrss, the
Python process: the tensors live there; p2pd's own buffers are not included), for the joiner before the
download -> after, for a donor after building its state -> after serving. The state is held once by each: a
donor serves its own tensors without a copy (a trainer's provider returns one snapshot copy), the joiner
receives into its template's tensors. The load average is printed before and after: numbers from a busy
machine are not comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
FINGERPRINT = "bench-state"


# --- the workers ----------------------------------------------------------------------------------------------


def state_spec(size_bytes: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype): 8 fp32 weight tensors (~90%), a bf16 flat outer state (the rest), a step."""
    weight = size_bytes * 9 // 10 // 8 // 4
    rows = max(1, weight // 1024)
    outer = max(1, (size_bytes - 8 * rows * 1024 * 4) // 2)
    spec = {f"model/layers.{i}.weight": ((rows, 1024), "float32") for i in range(8)}
    spec["outer/momentum"] = ((outer,), "bfloat16")
    spec["inner/0/step"] = ((), "float32")
    return spec


def _template(size_bytes: int) -> Any:
    import torch

    return {name: (shape, getattr(torch, dtype)) for name, (shape, dtype) in state_spec(size_bytes).items()}


def _digests(tensors: dict[str, Any]) -> dict[str, str]:
    from peerd.training.transfer.manifest import byte_view

    return {name: hashlib.sha256(byte_view(t)).hexdigest() for name, t in tensors.items()}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def _p2p(args: argparse.Namespace, initial_peers: list[str]) -> Any:
    from hivemind.p2p import P2P

    listen = f"/ip4/{args.addr}/tcp/0" if args.transport == "tcp" else f"/ip4/{args.addr}/udp/0/quic-v1"
    return await P2P.create(host_maddrs=[listen], initial_peers=initial_peers)


def _guard(p2p: Any) -> Any:
    from peerd.config import StreamLimits
    from peerd.wire.guard import StreamGuard
    from peerd.wire.membership import Membership

    return StreamGuard(p2p, Membership(), StreamLimits())


async def donor(args: argparse.Namespace) -> None:
    import torch

    from peerd.training.state import TrainingState
    from peerd.training.transfer.server import StateServer

    g = torch.Generator().manual_seed(args.seed)
    tensors = {name: torch.randn(shape, generator=g).to(dtype) for name, (shape, dtype) in _template(args.size).items()}
    state = TrainingState(100, tensors)
    p2p = await _p2p(args, [])
    try:
        async def provider() -> TrainingState:
            return state

        server = StateServer(_guard(p2p), FINGERPRINT, provider)
        await server.start()
        rss_before = _peak_rss_mb()
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        print("READY " + json.dumps({"maddrs": maddrs, "digests": _digests(tensors)}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # the harness closes stdin to stop us
        print("RESULT " + json.dumps({"bytes_sent": server.bytes_sent, "rss_before_mb": rss_before,
                                      "rss_peak_mb": _peak_rss_mb()}), flush=True)
    finally:
        await p2p.shutdown()


async def joiner(args: argparse.Namespace) -> None:
    from peerd.training.transfer.download import StateDownloader

    donors = json.loads(args.donors)
    p2p = await _p2p(args, [m for d in donors for m in d["maddrs"]])
    try:
        downloader = StateDownloader(_guard(p2p), FINGERPRINT, _template(args.size), max_bytes=args.size * 2)
        ids = [d["maddrs"][0].rsplit("/p2p/", 1)[1] for d in donors]
        rss_before = _peak_rss_mb()

        async def announce_kill_point() -> None:
            while True:
                status = downloader.status()
                if status["state"] == "downloading" and status["bytes_done"] >= args.kill_at * status["bytes_total"]:
                    print("KILL_POINT " + json.dumps(status), flush=True)
                    return
                await asyncio.sleep(0.05)  # a benchmark's poll of its own progress, not a test's wait

        watcher = asyncio.create_task(announce_kill_point()) if args.kill_at else None
        began = time.monotonic()
        state = await downloader.download(ids)
        seconds = time.monotonic() - began
        if watcher is not None:
            watcher.cancel()
        got = _digests(state.tensors)
        wrong = [name for name, digest in donors[-1]["digests"].items() if got.get(name) != digest]
        print("RESULT " + json.dumps({
            "seconds": seconds, "bytes": state.nbytes, "status": downloader.status(), "donor_ids": ids,
            "wrong_tensors": wrong, "rss_before_mb": rss_before, "rss_peak_mb": _peak_rss_mb(),
        }), flush=True)
    finally:
        await p2p.shutdown()


# --- the harness ----------------------------------------------------------------------------------------------


class Peers:
    """Worker processes, each in its own session so that killing one takes its p2pd along."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, name: str, prefix: list[str], argv: list[str]) -> subprocess.Popen[str]:
        log = open(self.logdir / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the process
        proc = subprocess.Popen(prefix + [sys.executable, __file__, *argv], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                                env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1"))
        self.procs.append(proc)
        return proc

    @staticmethod
    def line(proc: subprocess.Popen[str], prefix: str, what: str) -> dict[str, Any]:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(prefix + " "):
                return dict(json.loads(line[len(prefix) + 1 :]))
        raise RuntimeError(f"{what} ended without a {prefix} line (exit code {proc.wait()})")

    @staticmethod
    def kill(proc: subprocess.Popen[str]) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=10)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
            self.kill(proc)


def run(args: argparse.Namespace, addrs: list[str], prefixes: list[list[str]], tx_bytes: Any, logdir: Path) -> dict:
    n_donors = 2 if args.kill_donor else 1
    peers = Peers(logdir)
    common = ["--size", str(args.size), "--transport", args.transport]
    try:
        donors, ready = [], []
        for i in range(n_donors):
            proc = peers.start(f"donor{i}", prefixes[i], ["--role", "donor", "--addr", addrs[i], "--seed", "1",
                                                         *common])
            donors.append(proc)
            ready.append(peers.line(proc, "READY", f"donor {i}"))
        tx_before = [tx_bytes(i) for i in range(n_donors)]
        kill_at = ["--kill-at", str(args.kill_at if args.kill_donor else 0.0)]
        joiner = peers.start("joiner", prefixes[n_donors], ["--role", "joiner", "--addr", addrs[n_donors],
                                                            "--donors", json.dumps(ready), *kill_at, *common])
        if args.kill_donor:
            at = peers.line(joiner, "KILL_POINT", "the joiner")
            peers.kill(donors[0])
            print(f"   killed donor 0 at {at['bytes_done'] / 1e6:.1f} MB of {at['bytes_total'] / 1e6:.1f} MB", flush=True)
        result = peers.line(joiner, "RESULT", "the joiner")
        result["tx"] = [None if b is None else tx_bytes(i) - b for i, b in enumerate(tx_before)]
        for proc in donors:
            if proc.poll() is None and proc.stdin is not None:
                proc.stdin.close()
        result["donors"] = [None if proc.returncode is not None and proc.returncode < 0
                            else peers.line(proc, "RESULT", f"donor {i}") for i, proc in enumerate(donors)]
        return result
    finally:
        peers.close()


def print_table(args: argparse.Namespace, result: dict[str, Any]) -> None:
    status = result["status"]
    mb = 1e6
    rows = [("size", f"{result['bytes'] / mb:.1f} MB"), ("rate", f"{args.rate:g} Mbit/s" if args.env == "netns"
                                                              else "unshaped (loopback)"),
            ("transport", args.transport), ("seconds", f"{result['seconds']:.1f}"),
            ("achieved", f"{result['bytes'] * 8 / result['seconds'] / 1e6:.1f} Mbit/s")]
    for i, peer in enumerate(result["donor_ids"]):
        wire = result["tx"][i]
        rows.append((f"from donor {i}", f"{status['bytes_from'].get(peer, 0) / mb:.1f} MB payload"
                     + (f", {wire / mb:.1f} MB on its wire" if wire is not None else "")
                     + (" (killed)" if result["donors"][i] is None else "")))
    rows.append(("joiner peak RSS", f"{result['rss_before_mb']:.0f} -> {result['rss_peak_mb']:.0f} MB"))
    for i, donor_result in enumerate(result["donors"]):
        if donor_result is not None:
            peak = f"{donor_result['rss_before_mb']:.0f} -> {donor_result['rss_peak_mb']:.0f} MB"
            rows.append((f"donor {i} peak RSS", peak))
    rows.append(("donors tried", str(status["donors_tried"])))
    rows.append(("intact", "yes" if not result["wrong_tensors"] else f"NO: {result['wrong_tensors']}"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def harness(args: argparse.Namespace) -> int:
    from netns import NetnsLab, NetnsUnavailable

    args.size = int(args.size_mb * 1e6)
    logdir = Path(tempfile.mkdtemp(prefix="bench-state-"))
    print(f"state transfer: {args.size_mb:g} MB, {'2 donors, the first killed at ' + format(args.kill_at, '.0%') if args.kill_donor else '1 donor'}"
          f", {args.transport}, env {args.env}; load average {os.getloadavg()}", flush=True)
    n = 3 if args.kill_donor else 2
    try:
        if args.env == "netns":
            try:
                with NetnsLab(n, rate_mbit=args.rate) as lab:
                    print(f"   {lab.describe()}", flush=True)
                    result = run(args, [lab.addr(i) for i in range(n)], [lab.exec_prefix(i) for i in range(n)],
                                 lab.tx_bytes, logdir)
            except NetnsUnavailable as e:
                print(f"skipped: {e}")
                return 0
        else:
            result = run(args, ["127.0.0.1"] * n, [[]] * n, lambda i: None, logdir)
    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as e:
        print(f"FAILED: {e} (logs in {logdir})")
        return 1
    print_table(args, result)
    print(f"load average after: {os.getloadavg()}" + (f"; logs in {logdir}" if args.keep_logs else ""))
    if not args.keep_logs:
        for path in logdir.iterdir():
            path.unlink()
        logdir.rmdir()
    return 1 if result["wrong_tensors"] else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=250.0, help="state size in MB (1e6 bytes)")
    parser.add_argument("--rate", type=float, default=25.0, help="tbf rate of every port in Mbit/s (netns)")
    parser.add_argument("--kill-donor", action="store_true", help="two donors; the first is killed mid-transfer")
    parser.add_argument("--kill-at", type=float, default=0.4, help="share of the state held when it is killed")
    parser.add_argument("--transport", choices=["tcp", "quic"], default="tcp")
    parser.add_argument("--env", choices=["netns", "loopback"], default="netns")
    parser.add_argument("--keep-logs", action="store_true")
    # worker options (the harness passes these)
    parser.add_argument("--role", choices=["donor", "joiner"])
    parser.add_argument("--addr", default="127.0.0.1")
    parser.add_argument("--size", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--donors", default="[]")
    args = parser.parse_args()
    if args.role is None:
        return harness(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(donor(args) if args.role == "donor" else joiner(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
