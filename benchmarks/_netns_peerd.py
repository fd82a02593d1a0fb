"""`peerd start` inside a network namespace of benchmarks/netns.py, driven like any other PeerProcess.

``python -m _netns_peerd start ...`` (with this directory on PYTHONPATH) moves itself into the namespace named
by ``PEERD_BENCH_NETNS`` before peerd is imported, then runs peerd's CLI: p2pd and the DHT child inherit the
namespace, and :class:`NetnsPeer` keeps everything :class:`peerd.launcher.PeerProcess` does (ready line, log
file, process tree, stop and kill). A peer's control endpoint listens on loopback *inside* its namespace, out of
the root namespace's reach (nothing is routed there); ``NetnsPeer.status()`` asks it from a thread that has
joined the namespace (setns(2) moves only the calling thread).
"""

from __future__ import annotations

import ctypes
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from peerd.control.client import fetch_status
from peerd.launcher import PeerProcess

HERE = Path(__file__).resolve().parent
NETNS_ENV = "PEERD_BENCH_NETNS"
CLONE_NEWNET = 0x40000000


def enter_netns(name: str) -> None:
    """Moves the calling thread into the named network namespace (``ip netns add`` put it in /run/netns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


class NetnsPeer(PeerProcess):
    """A `peerd start` process in namespace ``netns``; status() reaches its control endpoint there."""

    def __init__(self, name: str, netns: str, args: list[str], log_dir: Path) -> None:
        pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
        super().__init__(name, args, log_dir, env={NETNS_ENV: netns, "PYTHONPATH": pythonpath},
                         module="_netns_peerd")
        self._inside = ThreadPoolExecutor(1, thread_name_prefix=f"netns-{name}", initializer=enter_netns,
                                          initargs=(netns,))

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        return self._inside.submit(fetch_status, self.control, timeout).result()

    def kill(self) -> None:
        try:
            super().kill()
        finally:
            self._inside.shutdown(wait=False, cancel_futures=True)


if __name__ == "__main__":
    # before peerd starts a thread or a child: they inherit the namespace of the thread that creates them
    enter_netns(os.environ.pop(NETNS_ENV))
    from peerd.cli import main

    sys.argv[0] = "peerd"
    main()
