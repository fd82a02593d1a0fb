"""Home routers on one machine: public hosts on a shared "internet" and hosts behind their own NAT.

    with NatLab(public=["relay", "pub"], natted=["a", "b"]) as lab:
        lab.addr("relay")          # '10.79.0.2', reachable from everyone
        lab.addr("a")              # '192.168.11.2', reachable from nobody outside a's home
        lab.ns("a")                # 'peerdnat-<pid>-a', for `ip netns exec` or setns(2)

Topology (nothing is created in, or routed from, the root namespace; <pid> is the process that built the lab):

    peerdnat-<pid>-wan: bridge br0, the internet (10.79.0.0/24)
    public host h:  peerdnat-<pid>-<h>, eth0 10.79.0.<k>/24 on br0
    natted host h:  peerdnat-<pid>-<h>, eth0 192.168.<10+k>.2/24, default route via its router
                    peerdnat-<pid>-r<h>, lan0 192.168.<10+k>.1 and wan0 10.79.0.<100+k> on br0, forwarding with
                    iptables MASQUERADE out of wan0 and only replies let back in (FORWARD: ESTABLISHED,RELATED)

So a natted host can dial any public host (its connections leave from its router's address), while no host can
open a connection to it: the internet has no route to its 192.168 network, and its router forwards only
replies. Two natted hosts cannot dial each other at all, like two home machines behind different routers.

Needs root and iproute2 + iptables; otherwise entering raises :class:`NatLabUnavailable` with the reason, and
:func:`nat_lab_or_skip` skips the test with it (in CI, where the test machines are root, it fails instead).
A lab's namespaces are removed on exit; on entry, those of labs whose process is gone (an interrupted run). Two
test runs on one machine each build their own lab and leave the other's alone.

Peers run inside a host's namespace as ``NetnsPeer`` (``benchmarks/_netns_peerd.py``, which the benchmarks use
too); :func:`public_maddr` is a public peer's address on the internet.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Self

import pytest

from peerd.launcher import PeerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _netns_peerd import NetnsPeer  # benchmarks/ is on sys.path, not a package

__all__ = ["NatLab", "NatLabUnavailable", "NetnsPeer", "nat_lab_or_skip", "public_maddr"]

PREFIX = "peerdnat-"
WAN = "7.79.0"


class NatLabUnavailable(RuntimeError):
    """The lab cannot be built here (not root, no iproute2 or iptables, kernel refuses)."""


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=20)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _builder_alive(ns: str) -> bool:
    """Whether the process that built namespace ``ns`` (``peerdnat-<pid>-<host>``) still runs."""
    owner = ns[len(PREFIX) :].split("-", 1)[0]
    if not owner.isdigit():
        return False  # named before labs carried their builder's pid
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_leftovers(prefix: str | None = None) -> None:
    """Removes the namespaces starting with ``prefix`` (one lab's), or without it those of labs whose builder
    is gone, killing the processes inside first."""
    for ns in _namespaces():
        if ns.startswith(prefix) if prefix is not None else ns.startswith(PREFIX) and not _builder_alive(ns):
            for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ValueError, ProcessLookupError):
                    pass
            _run(["ip", "netns", "del", ns], check=False)


def check_available() -> None:
    if not sys.platform.startswith("linux"):
        raise NatLabUnavailable(f"network namespaces need Linux (this is {sys.platform})")
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            raise NatLabUnavailable(f"'{tool}' is not installed")
    if os.geteuid() != 0:
        raise NatLabUnavailable("creating network namespaces and NAT rules needs root")


class NatLab:
    """Public hosts and natted hosts (each behind its own masquerading router); see the module docstring."""

    def __init__(self, public: list[str], natted: list[str]) -> None:
        self.public = list(public)
        self.natted = list(natted)
        self.prefix = f"{PREFIX}{os.getpid()}-"
        self.wan_ns = f"{self.prefix}wan"
        self._addrs: dict[str, str] = {}
        for k, name in enumerate(self.public, start=2):
            self._addrs[name] = f"{WAN}.{k}"
        for k, name in enumerate(self.natted, start=1):
            self._addrs[name] = f"192.168.{10 + k}.2"
            self._addrs[f"r{name}"] = f"{WAN}.{100 + k}"

    def ns(self, host: str) -> str:
        return f"{self.prefix}{host}"

    def addr(self, host: str) -> str:
        return self._addrs[host]

    def router_addr(self, host: str) -> str:
        """The public address a natted host's connections come from."""
        return self._addrs[f"r{host}"]

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def __enter__(self) -> Self:
        check_available()
        cleanup_leftovers()
        cleanup_leftovers(self.prefix)
        try:
            self._build()
        except BaseException as e:
            cleanup_leftovers(self.prefix)
            if isinstance(e, RuntimeError):
                raise NatLabUnavailable(f"could not build the NAT lab: {e}") from e
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        cleanup_leftovers(self.prefix)

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _plug(self, ns: str, dev: str, port: str, cidr: str) -> None:
        """A veth from namespace ``ns`` (as ``dev``, address ``cidr``) to the internet bridge (as ``port``)."""
        _run(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.wan_ns])
        _run(["ip", "-n", self.wan_ns, "link", "set", port, "master", "br0"])
        _run(["ip", "-n", self.wan_ns, "link", "set", port, "up"])
        _run(["ip", "-n", ns, "addr", "add", cidr, "dev", dev])
        _run(["ip", "-n", ns, "link", "set", dev, "up"])

    def _build(self) -> None:
        self._add_ns(self.wan_ns)
        _run(["ip", "-n", self.wan_ns, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.wan_ns, "link", "set", "br0", "up"])
        for k, name in enumerate(self.public, start=2):
            self._add_ns(self.ns(name))
            self._plug(self.ns(name), "eth0", f"h{k}", f"{self.addr(name)}/24")
        for k, name in enumerate(self.natted, start=1):
            host, router, lan = self.ns(name), self.ns(f"r{name}"), f"192.168.{10 + k}"
            self._add_ns(host)
            self._add_ns(router)
            self._plug(router, "wan0", f"r{k}", f"{self.router_addr(name)}/24")
            _run(["ip", "link", "add", "lan0", "netns", router, "type", "veth", "peer", "name", "eth0",
                  "netns", host])
            _run(["ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan0"])
            _run(["ip", "-n", router, "link", "set", "lan0", "up"])
            _run(["ip", "-n", host, "addr", "add", f"{lan}.2/24", "dev", "eth0"])
            _run(["ip", "-n", host, "link", "set", "eth0", "up"])
            _run(["ip", "-n", host, "route", "add", "default", "via", f"{lan}.1"])
            in_router = ["ip", "netns", "exec", router]
            _run(in_router + ["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
            _run(in_router + ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE"])
            _run(in_router + ["iptables", "-P", "FORWARD", "DROP"])
            _run(in_router + ["iptables", "-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT"])
            _run(in_router + ["iptables", "-A", "FORWARD", "-i", "wan0", "-o", "lan0", "-m", "conntrack",
                              "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"])

    def can_connect(self, src: str, dst_addr: str, port: int, timeout: float = 3.0) -> bool:
        """Whether a TCP connection from host ``src`` to ``dst_addr:port`` is accepted (for checking the lab)."""
        code = ("import socket,sys\n"
                "s=socket.socket(); s.settimeout(float(sys.argv[3]))\n"
                "try:\n  s.connect((sys.argv[1],int(sys.argv[2])))\nexcept OSError:\n  sys.exit(1)\n")
        proc = subprocess.run(self.exec_prefix(src) + [sys.executable, "-c", code, dst_addr, str(port), str(timeout)],
                              check=False, capture_output=True, timeout=timeout + 10)
        return proc.returncode == 0


@contextlib.contextmanager
def nat_lab_or_skip(public: list[str], natted: list[str]) -> Iterator[NatLab]:
    """The lab for a test; skips with the reason where it cannot be built, except in CI (``CI=true``)."""
    try:
        lab = NatLab(public, natted).__enter__()
    except NatLabUnavailable as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"NAT lab unavailable: {e}")
    try:
        yield lab
    finally:
        lab.__exit__(None, None, None)


def public_maddr(peer: PeerProcess, address: str) -> str:
    """The multiaddr of ``peer`` on the lab's internet, where its host has ``address``."""
    return next(m for m in peer.ready["maddrs"] if f"/ip4/{address}/" in m)
