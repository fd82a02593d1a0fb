"""A throw-away bandwidth-limited LAN made of Linux network namespaces, for benchmarks.

    with NetnsLab(4, rate_mbit=100) as lab:
        lab.addr(0)            # '10.77.0.2'
        lab.exec_prefix(0)     # ['ip', 'netns', 'exec', 'peerdbench-p0']
        lab.probe_throughput(0, 1)   # measured line rate in Mbit/s

Topology (nothing is created in, or routed from, the root namespace):

    peerdbench-p<i>: lo + eth0 (10.77.0.<i+2>/24)  --veth--  p<i> in peerdbench-sw, enslaved to bridge br0

Shaping: ``tc qdisc add dev <veth> root tbf rate <R>mbit burst 32kbit latency 400ms`` on *both* ends of every
peer's veth pair: on eth0 inside the peer namespace (the peer's upload) and on p<i> inside the switch namespace
(the bridge's egress towards the peer, i.e. the peer's download). So every peer has a full-duplex R Mbit/s port
on an otherwise unlimited switch, like a host on a 100 Mbit switched LAN. A transfer between two peers crosses
two R-limited queues in series, which still tops out at R.

Why the tc settings matter (they are part of the benchmark's definition, do not tune them to a result):
``latency 400ms`` lets each tbf queue hold ~5 MB at 100 Mbit/s, a deep, bufferbloated queue like a cheap
switch or home router; TCP (BBR here) keeps it partly filled, so a credit or ACK sent against a loaded
direction waits behind that data. ``burst 32kbit`` (4 KB, under three full packets) allows no bursts above
the rate. Shaping both ends of every veth gives each peer a full-duplex port, so an all-reduce, which sends
and receives at once, is limited on both its upload and its download.

The lab needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and the iproute2 ``ip``/``tc`` tools; otherwise entering
it raises :class:`NetnsUnavailable` with a one-line reason. Everything named ``peerdbench-*`` is removed on exit,
on exceptions, on Ctrl-C and on SIGTERM, and leftovers of an interrupted earlier run are removed on entry
(processes still running inside such leftover namespaces are killed by pid first). A lock file serialises
concurrent labs on one machine, since they would otherwise tear each other's namespaces down.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

PREFIX = "peerdbench-"
SWITCH_NS = f"{PREFIX}sw"
LOCK_PATH = Path("/tmp/peerdbench-netns.lock")
SUBNET = "10.77.0"


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be used here (not root, no iproute2, kernel refuses, ...)."""


def _run(cmd: list[str], check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_and_delete(ns: str) -> None:
    """Kill what still runs in one of *our* namespaces (by pid), then delete it (which destroys its veths)."""
    pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass
    _run(["ip", "netns", "del", ns], check=False)


def cleanup_leftovers() -> list[str]:
    """Remove every ``peerdbench-*`` namespace (ours by name). Returns the names that were removed."""
    removed = [ns for ns in _list_namespaces() if ns.startswith(PREFIX)]
    for ns in removed:
        _kill_and_delete(ns)
    return removed


def check_available() -> None:
    """Raise NetnsUnavailable with a human reason if a lab cannot be built here."""
    if not sys.platform.startswith("linux"):
        raise NetnsUnavailable(f"network namespaces need Linux (this is {sys.platform})")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"'{tool}' (iproute2) is not installed")
    if os.geteuid() != 0:
        raise NetnsUnavailable("creating network namespaces needs root (run with sudo)")


class NetnsLab:
    """n peer namespaces on one shaped bridge; see the module docstring."""

    def __init__(self, n_peers: int, rate_mbit: float | None = 100, burst: str = "32kbit", latency: str = "400ms",
                 shape_ingress: bool = True, lock_timeout: float = 600.0):
        assert 1 <= n_peers <= 200
        self.n_peers = n_peers
        self.rate_mbit = rate_mbit
        self.burst, self.latency = burst, latency
        self.shape_ingress = shape_ingress
        self.lock_timeout = lock_timeout
        self._created: list[str] = []
        self._lock_fd: int | None = None
        self._old_sigterm = None

    # ---- public helpers -------------------------------------------------------------------------------------
    def ns(self, i: int) -> str:
        return f"{PREFIX}p{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 2}"

    def iface(self, i: int) -> str:
        """Peer i's interface name (the same, eth0, in every peer namespace)."""
        del i
        return "eth0"

    def exec_prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns(i)]

    def describe(self) -> str:
        shaping = "unshaped" if not self.rate_mbit else (
            f"tbf rate {self.rate_mbit:g}mbit burst {self.burst} latency {self.latency} on each peer's egress"
            + (" and ingress (bridge-side veth)" if self.shape_ingress else " only"))
        return f"{self.n_peers} namespaces {PREFIX}p0..p{self.n_peers - 1} ({SUBNET}.2-{self.n_peers + 1}/24) " \
               f"on bridge br0 in {SWITCH_NS}; {shaping}"

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        check_available()
        self._acquire_lock()
        try:
            self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: rely on normal exception unwinding
            self._old_sigterm = None
        try:
            cleanup_leftovers()
            self._build()
        except BaseException as e:
            self.close()
            if isinstance(e, RuntimeError) and not isinstance(e, NetnsUnavailable):
                raise NetnsUnavailable(f"could not build the namespace lab: {e}") from e
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            for ns in reversed(self._created):
                _kill_and_delete(ns)
            self._created.clear()
            cleanup_leftovers()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None
            self._release_lock()

    @staticmethod
    def _on_sigterm(signum, frame):
        raise KeyboardInterrupt("SIGTERM")  # unwinds through __exit__, which tears the lab down

    def _acquire_lock(self) -> None:
        fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.lock_timeout
        announced = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise NetnsUnavailable(f"another netns benchmark holds {LOCK_PATH}")
                if not announced:
                    print(f"[netns] waiting for another netns benchmark to finish ({LOCK_PATH})", flush=True)
                    announced = True
                time.sleep(0.5)
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _tbf(self, ns: str, dev: str) -> None:
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
              "rate", f"{self.rate_mbit:g}mbit", "burst", self.burst, "latency", self.latency])

    def _build(self) -> None:
        self._add_ns(SWITCH_NS)
        _run(["ip", "-n", SWITCH_NS, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", SWITCH_NS, "link", "set", "br0", "up"])
        for i in range(self.n_peers):
            ns, port = self.ns(i), f"p{i}"
            self._add_ns(ns)
            # Both ends are created directly inside their namespaces: nothing ever appears in the root namespace.
            _run(["ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", SWITCH_NS])
            _run(["ip", "-n", SWITCH_NS, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", SWITCH_NS, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            if self.rate_mbit:
                self._tbf(ns, "eth0")  # peer upload
                if self.shape_ingress:
                    self._tbf(SWITCH_NS, port)  # peer download
        # Bridge ports go through STP-less learning immediately; wait until every peer reaches every other peer.
        if self.n_peers > 1:
            self._wait_reachable()

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        code = ("import socket,sys,time\n"
                "d=time.monotonic()+float(sys.argv[2])\n"
                "while True:\n"
                "  s=socket.socket(); s.settimeout(0.5)\n"
                "  try:\n"
                "    s.connect((sys.argv[1],9)); break\n"
                "  except ConnectionRefusedError: break\n"   # RST from the peer: the path works
                "  except OSError:\n"
                "    if time.monotonic()>d: sys.exit(1)\n"
                "    time.sleep(0.1)\n"
                "  finally: s.close()\n")
        for i in range(1, self.n_peers):
            proc = subprocess.run(self.exec_prefix(0) + [sys.executable, "-c", code, self.addr(i), str(timeout)],
                                  check=False, capture_output=True, text=True, timeout=timeout + 5)
            if proc.returncode != 0:
                raise RuntimeError(f"peer 0 cannot reach {self.addr(i)} inside the lab: {proc.stderr.strip()}")

    # ---- measurements ---------------------------------------------------------------------------------------
    def tx_bytes(self, i: int) -> int:
        """Bytes peer i has put on its link so far (read from the switch side: rx of p<i>)."""
        out = _run(["ip", "-n", SWITCH_NS, "-j", "-s", "link", "show", f"p{i}"]).stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])

    def probe_throughput(self, src: int = 0, dst: int = 1, seconds: float = 5.0, port: int = 5201) -> dict:
        """Raw TCP bulk transfer src -> dst for ``seconds``; returns {'mbit': ..., 'bytes': ..., 'seconds': ...}.

        The rate is taken at the receiver over the second half of the transfer, after slow start and after the
        sender's tbf queue has filled, i.e. the sustained line rate a long bulk transfer sees.
        """
        receiver = (
            "import socket,sys,time,json\n"
            "ls=socket.socket(); ls.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            "ls.bind((sys.argv[1],int(sys.argv[2]))); ls.listen(1); ls.settimeout(15)\n"
            "print('ready',flush=True)\n"
            "c,_=ls.accept(); c.settimeout(15); marks=[]; total=0; buf=bytearray(1<<20)\n"
            "while True:\n"
            "  k=c.recv_into(buf)\n"
            "  if not k: break\n"
            "  total+=k; marks.append((time.monotonic(),total))\n"
            "t0,b0=marks[0]; t1,b1=marks[-1]; mid=[m for m in marks if m[0]>=t0+(t1-t0)/2][0]\n"
            "print(json.dumps({'bytes':total,'seconds':t1-t0,'mbit':(b1-mid[1])*8/(t1-mid[0])/1e6,"
            "'mbit_whole':(b1-b0)*8/(t1-t0)/1e6}),flush=True)\n"
        )
        sender = (
            "import socket,sys,time\n"
            "s=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=10)\n"
            "d=time.monotonic()+float(sys.argv[3]); chunk=b'x'*(1<<16)\n"
            "while time.monotonic()<d: s.sendall(chunk)\n"
            "s.close()\n"
        )
        rx = subprocess.Popen(self.exec_prefix(dst) + [sys.executable, "-c", receiver, self.addr(dst), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        tx = None
        try:
            if rx.stdout.readline().strip() != "ready":
                raise RuntimeError(f"probe receiver failed: {rx.stderr.read().strip()}")
            tx = subprocess.Popen(self.exec_prefix(src) + [sys.executable, "-c", sender, self.addr(dst), str(port),
                                                           str(seconds)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  start_new_session=True)
            tx.wait(timeout=seconds + 20)
            out, err = rx.communicate(timeout=20)
            if rx.returncode != 0:
                raise RuntimeError(f"probe receiver failed: {err.strip()}")
            return json.loads(out.strip().splitlines()[-1])
        finally:
            for proc in (tx, rx):
                if proc is not None and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


if __name__ == "__main__":  # manual check: build, probe, tear down
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    try:
        with NetnsLab(n, rate_mbit=100) as lab:
            print(lab.describe())
            print("probe p0 -> p1:", lab.probe_throughput(0, 1, seconds=5))
    except NetnsUnavailable as e:
        print(f"skipped: {e}")
    print("left over:", [ns for ns in _list_namespaces() if ns.startswith(PREFIX)])
