"""The DHT child process's ties to the daemon.

hivemind runs the DHT in a child process that owns p2pd. We start that child in its own process group so
that a Ctrl-C in the terminal reaches only the daemon, which can then announce ``leaving`` through a still
working DHT before shutting it down; and that group kills itself if the daemon itself dies abruptly.

It also hands p2pd the flags hivemind's ``P2P.create`` has no parameter for (the relay service's limits, its
metrics address): hivemind builds p2pd's command line in ``P2P._make_process_args``, and only this child
process starts p2pd, so wrapping that one function here adds flags without touching hivemind anywhere else.
"""

from __future__ import annotations

import asyncio
import gc
import os
import select
import signal
import threading
from collections.abc import Mapping
from typing import Any

from hivemind.dht import DHT
from hivemind.p2p import P2P

__all__ = ["IsolatedDHT", "add_p2pd_flags"]


class IsolatedDHT(DHT):  # type: ignore[misc]  # hivemind ships no type information
    """hivemind's DHT process, detached from the terminal's process group and tied to our lifetime."""

    def __init__(self, *args: Any, p2pd_flags: Mapping[str, int | str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.p2pd_flags = dict(p2pd_flags or {})  # read in run(), in the child: before start()

    def start(self) -> None:
        # Fork shares the daemon's pages with the child until either writes to them, and a garbage collection
        # writes to every object it visits (torch's and hivemind's modules are many of them). Frozen
        # objects are never visited, so those pages stay shared; they are import-time objects that live for
        # the whole process anyway.
        gc.collect()
        gc.freeze()
        super().start()

    async def close(self) -> None:
        """Stops the child and its p2pd (hivemind's ``shutdown`` blocks until they have exited)."""
        await asyncio.to_thread(self.shutdown)

    def run(self) -> None:
        os.setpgid(0, 0)
        _die_with_parent()
        add_p2pd_flags(self.p2pd_flags)
        super().run()


def add_p2pd_flags(flags: Mapping[str, int | str]) -> None:
    """Makes every p2pd this process starts get ``-name=value`` for each flag, after hivemind's own."""
    if not flags:
        return
    build = P2P._make_process_args

    def with_flags(*args: Any, **kwargs: Any) -> list[str]:
        return [*build(*args, **kwargs), *(f"-{name}={value}" for name, value in flags.items())]

    P2P._make_process_args = staticmethod(with_flags)


def _die_with_parent() -> None:
    """Kills this process group (the DHT child and its p2pd) as soon as the daemon that forked it is gone.

    A graceful daemon shuts the DHT down itself; this covers SIGKILL/OOM of the daemon, which would otherwise
    leave the DHT child and p2pd running (hivemind's child catches SIGTERM, so PDEATHSIG alone is not enough).
    """
    parent = os.getppid()
    try:
        parent_fd = os.pidfd_open(parent)
    except (AttributeError, OSError):
        return  # kernel without pidfd: the daemon's own shutdown path still stops the DHT
    if os.getppid() != parent:  # parent died before we got the fd
        os.killpg(0, signal.SIGKILL)

    def watch() -> None:
        select.select([parent_fd], [], [])  # readable once the parent process has exited
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="peerd-parent-watch", daemon=True).start()
