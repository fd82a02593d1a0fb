"""What a stranger's CPU and slot attacks cost members: rounds per minute with and without them, same run.

Two members train configs/synthetic.yaml in a private swarm. The run is a sequence of phases of --seconds each:

  quiet     no attacker
  burner    a process that only burns CPU, capped like the attackers (below): what their CPU alone costs
  cpu       a stranger (tests/integration/stranger.py) stores 3.5 MiB of records signed with RSA keys whose
            public exponent is as long as their 3,072-bit modulus, to each member's DHT node, one request
            after the other for the whole phase
  slots     --identities stranger identities hold --streams silent streams each to each member's averaging
            handler, re-opening every one the member closes
  both      cpu and slots together
  quiet     no attacker again

and prints each phase's rounds per minute (averaging rounds both members completed, from their status),
the members' own CPU use (their process trees) and the load average. The attackers run on the same machine,
so what they burn themselves (a fresh 3,072-bit key per request, 16 p2pd daemons per member) would slow the
members too: run as root, they are held to --attacker-cores in a cgroup of their own (cgroup v1's cpu
controller, or v2's), and the burner phase, held alike, is the baseline the attacks compare to.
``-o key=value`` goes to the members (``-o swarm.streams.disconnect_unproven=false`` runs them without that
defence). Then, as the cost the defences avoid, it times one such store request to a
light peer running peerd and to one with the key check and the member tag's order switched off
(tests/integration/undefended.py): how long the peer's loop is held.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_stranger.py --seconds 60 [--attacker-cores 0.5] [-o k=v]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from peerd.averaging.allreduce import HANDLER_NAME
from peerd.launcher import LocalSwarm, PeerProcess, wait_for
from peerd.wire.membership import generate_secret

REPO = Path(__file__).resolve().parents[1]
SYNTHETIC = REPO / "configs" / "synthetic.yaml"
LOCAL = REPO / "configs" / "local.yaml"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
MiB = 1 << 20
CGROUPS = (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup"))  # v1's cpu controller, else v2 with cpu enabled


class Cap:
    """A cgroup whose processes share ``cores`` of CPU; inert (``path`` None) without root or a cpu controller."""

    def __init__(self, cores: float) -> None:
        self.cores = cores
        self.path: Path | None = None
        if cores <= 0 or os.geteuid() != 0:
            return
        v1, v2 = CGROUPS
        if (v1 / "cpu.cfs_quota_us").exists():
            self.path = v1 / "peerd-bench-attackers"
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text("100000")
            (self.path / "cpu.cfs_quota_us").write_text(str(int(cores * 100000)))
        elif (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text().split():
            self.path = v2 / "peerd-bench-attackers"
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{int(cores * 100000)} 100000")

    def add(self, processes: list[subprocess.Popen[str]]) -> None:
        """Moves each process and its children (p2pd daemons included) into the cgroup."""
        if self.path is None:
            return
        for process in processes:
            try:
                tree = [process.pid] + [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for pid in tree:
                try:
                    (self.path / "cgroup.procs").write_text(str(pid))
                except OSError:  # gone meanwhile
                    pass


def burner() -> list[subprocess.Popen[str]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], text=True, start_new_session=True)]


def stranger(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.integration.stranger", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=REPO, env=ENV, start_new_session=True)


def cpu_attack(maddrs: list[str], key: str, nbytes: int) -> list[subprocess.Popen[str]]:
    """One looping stranger per member: each `cpu` run is one 4 MiB store request; the loop restarts it."""
    loop = ("import subprocess, sys\nwhile True:\n    subprocess.run([sys.executable, '-m', "
            "'tests.integration.stranger', 'cpu', sys.argv[1], sys.argv[2], sys.argv[3]], stdout=subprocess.DEVNULL)")
    return [subprocess.Popen([sys.executable, "-c", loop, maddr, key, str(nbytes)], cwd=REPO, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            for maddr in maddrs]


def slot_attack(maddrs: list[str], identities: int, streams: int) -> list[subprocess.Popen[str]]:
    attackers = [stranger("slots", maddr, str(identities), str(streams), HANDLER_NAME) for maddr in maddrs]
    for attacker in attackers:
        assert attacker.stdout is not None
        attacker.stdout.readline()  # its ready line: the streams are open
    return attackers


def stop(processes: list[subprocess.Popen[str]]) -> None:
    """Stops each attacker with its whole process group (a cpu loop's current store request included)."""
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for process in processes:
        process.wait(30)
        if process.stdout is not None:
            process.stdout.close()


def rounds(peers: list[PeerProcess]) -> int:
    return min(int(p.status(timeout=60)["training"]["rounds_ok"]) for p in peers)


def cpu_seconds(peers: list[PeerProcess]) -> float:
    """CPU time used so far by the members' process trees (daemon, DHT child, p2pd)."""
    total = 0.0
    for peer in peers:
        for pid in peer.alive_tree():
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
    return total


def phase(name: str, peers: list[PeerProcess], seconds: float) -> float:
    """Rounds per minute over one phase; also the members' own CPU use meanwhile (attackers run on the same
    machine, so the load and the rate include what the attack costs the attacker)."""
    start, started, cpu = rounds(peers), time.monotonic(), cpu_seconds(peers)
    load = os.getloadavg()[0]
    wait_for(lambda: time.monotonic() - started >= seconds, seconds + 5, f"the {name} phase", 1.0)
    elapsed = time.monotonic() - started
    rate = (rounds(peers) - start) / elapsed * 60
    used = (cpu_seconds(peers) - cpu) / elapsed
    print(f"{name:6s} {rate:7.1f} rounds/min   members' CPU {used:4.2f} cores   (load {load:.1f} -> "
          f"{os.getloadavg()[0]:.1f})", flush=True)
    return rate


def members_under_attack(seconds: float, identities: int, streams: int, nbytes: int, cap: Cap,
                         overrides: list[str], with_cpu: bool = True) -> None:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-stranger-"))
    secret = log_dir / "swarm.secret"
    generate_secret(secret)
    args = ["--swarm-secret", str(secret), "-o", "training.wait_for_peers=2", "-o", "logging.level=WARNING"]
    args += [a for o in overrides for a in ("-o", o)]
    with LocalSwarm(SYNTHETIC, log_dir=log_dir, extra_args=args) as swarm:
        swarm.start(2, timeout=120)
        members = swarm.peers
        for member in members:
            member.remember_tree()
        wait_for(lambda: rounds(members) >= 5, 120, "the members to average 5 rounds", 1.0)
        maddrs = [m.ready["maddrs"][0] for m in members]
        stores = f"cpu = {nbytes / MiB:g} MiB store requests back to back per member, " if with_cpu else ""
        print(f"2 members, configs/synthetic.yaml, private swarm; attackers: {stores}slots = {identities} identities "
              f"x {streams} streams per member; "
              f"attackers held to {cap.cores if cap.path else 'any number of'} cores; members: {overrides or 'defaults'}")

        def attacked(name: str, start: Callable[[], list[subprocess.Popen[str]]]) -> None:
            attack = start()
            cap.add(attack)
            try:
                phase(name, members, seconds)
            finally:
                stop(attack)

        def cpu() -> list[subprocess.Popen[str]]:
            return cpu_attack(maddrs, "peerd-synthetic.peers", nbytes)

        phase("quiet", members, seconds)
        attacked("burner", burner)
        if with_cpu:
            attacked("cpu", cpu)
        attack = slot_attack(maddrs, identities, streams)
        cap.add(attack)
        try:
            phase("slots", members, seconds)
            if with_cpu:
                attacked("both", cpu)
        finally:
            stop(attack)
        phase("quiet", members, seconds)
        for member in members:
            status = member.status(timeout=60)
            print(f"{member.name}: refused streams {status['membership']['streams_refused']}, disconnected "
                  f"{status['membership'].get('peers_disconnected', 0)} peers, records "
                  f"{ {k: v for k, v in status['records_dropped'].items() if v} }")


def one_store(undefended: bool, nbytes: int) -> None:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-stranger-store-"))
    args = ["--config", str(LOCAL), "--control-port", "0", "-o", "logging.level=ERROR"]
    args += ["--undefended", "key-check"] if undefended else []
    peer = PeerProcess("light", args, log_dir, env=ENV,
                       module="tests.integration.undefended" if undefended else "peerd")
    try:
        peer.wait_ready(90)
        out = subprocess.run([sys.executable, "-m", "tests.integration.stranger", "cpu", peer.ready["maddrs"][0],
                              "peerd-local.peers", str(nbytes)], capture_output=True, text=True, cwd=REPO, env=ENV,
                             timeout=600, check=True)
        report = json.loads(out.stdout.strip().splitlines()[-1])
        label = "key check off" if undefended else "peerd"
        print(f"one store of {report['bytes'] / MiB:.2f} MiB ({report['records']} records) to a light peer, "
              f"{label:13s}: answered in {report['took']:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        peer.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--identities", type=int, default=16)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--attacker-cores", type=float, default=0.5, help="CPU the attackers share, in a "
                        "cgroup (root only; 0: uncapped)")
    parser.add_argument("-o", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for the members")
    parser.add_argument("--slots-only", action="store_true", help="only the quiet, burner and slots phases, and "
                        "no store request timed against a light peer")
    parser.add_argument("--mib", type=float, default=3.5, help="records per store request, MiB (a request "
                        "carries at most 4 MiB)")
    options = parser.parse_args()
    nbytes = int(options.mib * MiB)
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    members_under_attack(options.seconds, options.identities, options.streams, nbytes, Cap(options.attacker_cores),
                         options.overrides, with_cpu=not options.slots_only)
    for undefended in () if options.slots_only else (False, True):
        one_store(undefended, nbytes)


if __name__ == "__main__":
    main()
