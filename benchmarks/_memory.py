"""Memory of a peer's whole process tree (daemon, DHT child, p2pd, any torch_shm_manager), for the benchmarks.

RSS counts every page a process maps, so pages shared between processes (torch's libraries, the DHT child's
pages inherited from the daemon by fork) are counted once per process; PSS splits each shared page between
the processes that map it, so PSS summed over every process on the machine is the memory really used.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil

MIB = 2**20


@dataclass
class TreeMemory:
    rss: float = 0.0  # MiB, summed over the tree
    pss: float = 0.0
    uss: float = 0.0  # pages no other process maps: what stopping this tree gives back
    pss_anon: float = 0.0  # of pss: heap, stacks (what the peer really holds)
    pss_file: float = 0.0  # of pss: mapped files (libraries; the kernel can drop and re-read these)
    parts: list[tuple[str, float, float]] = field(default_factory=list)  # (process name, RSS, PSS) in MiB

    def describe(self) -> str:
        return ", ".join(f"{name} {rss:.0f}/{pss:.0f}" for name, rss, pss in self.parts)


def tree_memory(pids: Iterable[int]) -> TreeMemory:
    """RSS, PSS and USS summed over ``pids`` (those still running), in MiB."""
    total = TreeMemory()
    for pid in sorted(set(pids)):
        try:
            proc = psutil.Process(pid)
            info = proc.memory_full_info()
            name = proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if proc.status() == psutil.STATUS_ZOMBIE:
            continue
        total.rss += info.rss / MIB
        total.pss += info.pss / MIB
        total.uss += info.uss / MIB
        anon, file = _pss_split(pid)
        total.pss_anon += anon
        total.pss_file += file
        total.parts.append((name, info.rss / MIB, info.pss / MIB))
    return total


def _pss_split(pid: int) -> tuple[float, float]:
    """(anonymous, file-backed) parts of a process's PSS in MiB, from the kernel's smaps_rollup."""
    found = {"Pss_Anon:": 0.0, "Pss_File:": 0.0}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                name, _, rest = line.partition(" ")
                if name in found:
                    found[name] = int(rest.split()[0]) / 1024
    except OSError:
        pass
    return found["Pss_Anon:"], found["Pss_File:"]


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants now (torch_shm_manager and p2pd included)."""
    try:
        root = psutil.Process(pid)
        return [pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []
