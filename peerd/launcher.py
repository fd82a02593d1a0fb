"""Local swarms of real `peerd start` processes: the newcomer's first command and the tests' fixture.

Each peer is a separate OS process with its own p2pd, on loopback, free ports, bootstrapped from the first
peer's printed address. Every process tree is reaped, also when something fails half-way.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

import psutil

from peerd.control.client import fetch_json, fetch_status
from peerd.errors import DaemonError, PeerdError

T = TypeVar("T")


def wait_for(condition: Callable[[], T | None], timeout: float, what: str, interval: float = 0.2) -> T:
    """Re-checks ``condition`` until it returns a truthy value; raises TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)  # polling interval of a bounded condition check, not a synchronisation guess


def describe_process(pid: int) -> str:
    try:
        proc = psutil.Process(pid)
        return f"{pid} {proc.name()} ({proc.status()})"
    except psutil.NoSuchProcess:
        return f"{pid} (gone)"


class PeerProcess:
    """One `peerd start` subprocess with its ready line, log file and whole process tree."""

    def __init__(
        self, name: str, args: Sequence[str], log_dir: Path, env: dict[str, str] | None = None, module: str = "peerd"
    ) -> None:
        """``module``: what ``python -m`` runs with ``start`` and ``args`` (tests run patched peers this way)."""
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - the child writes to it until stop() closes it
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "start", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        self._lines: queue.Queue[bytes] = queue.Queue()
        self._tree: set[int] = {self.proc.pid}
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()
        self.ready: dict[str, Any] = {}
        self.ready_after: float | None = None
        self.orphans: list[str] = []

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        if self.ready:
            return self.ready
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise DaemonError(f"{self.name} exited with code {self.proc.returncode} before it was "
                                      f"ready:\n{self.log_tail()}") from None
                continue
            try:
                info = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(info, dict) and info.get("event") == "ready":
                self.ready = info
                self.ready_after = time.monotonic() - self.started_at
                self.remember_tree()
                return info
        raise DaemonError(f"{self.name} printed no ready line within {timeout:.0f}s:\n{self.log_tail()}")

    @property
    def control(self) -> str:
        return str(self.ready["control"])

    @property
    def peer_id(self) -> str:
        return str(self.ready["peer_id"])

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        return fetch_status(self.control, timeout=timeout)

    def history(self, points: int = 1000, timeout: float = 5.0) -> dict[str, Any]:
        """The training curves and last rounds (``/history``): ``loss``, ``validation_loss``, ``rounds``."""
        return dict(fetch_json(self.control, f"/history?points={points}", timeout)["training"] or {})

    def seen_peer_ids(self) -> set[str]:
        try:
            return {peer["peer_id"] for peer in self.status()["peers"]}
        except PeerdError:
            return set()

    def remember_tree(self) -> None:
        """Records every descendant (the DHT child and p2pd run in their own process group)."""
        try:
            self._tree |= {child.pid for child in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def alive_tree(self) -> list[int]:
        return alive_pids(self._tree)

    def send(self, sig: signal.Signals) -> None:
        self.remember_tree()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signals the daemon and waits for it; returns its exit code (-9 if it had to be killed).

        Descendants still running a moment after the daemon exited are recorded in ``orphans`` (a clean
        shutdown leaves none), then killed.
        """
        self.send(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = -9
        try:
            # torch_shm_manager notices its clients are gone on its own schedule; slow on a loaded machine
            wait_for(lambda: not self.alive_tree(), 10.0, "descendants to exit", interval=0.05)
        except TimeoutError:
            self.orphans = [describe_process(pid) for pid in self.alive_tree()]
        self.kill()
        return code

    def kill(self) -> None:
        """SIGKILLs the daemon and every descendant it ever had; safe to call repeatedly."""
        self.remember_tree()
        for pid in self._tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        # Descendants may hold the stdout pipe open a little longer; the reader ends at EOF.
        self._reader.join(5)
        if self.proc.stdout is not None and not self._reader.is_alive():
            self.proc.stdout.close()
        if not self._log.closed:
            self._log.close()

    def log_tail(self, lines: int = 25) -> str:
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(f"  [{self.name}] {line}" for line in text[-lines:])


class LocalSwarm:
    """N peers on loopback; peer 0 is the bootstrap, the rest join through its first visible address."""

    def __init__(self, config_path: Path, log_dir: Path | None = None, extra_args: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        """``env``: added to every peer's environment (each gets ``OMP_NUM_THREADS=1`` unless it says else)."""
        self.config_path = config_path
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="peerd-swarm-"))
        self.extra_args = list(extra_args)
        self.env = env
        self.peers: list[PeerProcess] = []

    def spawn_peer(self, extra_args: Sequence[str] = ()) -> PeerProcess:
        """Launches a peer (joining through peer 0 unless it is peer 0) without waiting for it."""
        args = ["--config", str(self.config_path), "--control-port", "0", *self.extra_args, *extra_args]
        if self.peers:
            args += ["--initial-peers", self.peers[0].ready["maddrs"][0]]
        peer = PeerProcess(f"peer{len(self.peers)}", args, self.log_dir, env=self.env)
        self.peers.append(peer)
        return peer

    def add_peer(self, extra_args: Sequence[str] = (), timeout: float = 60.0) -> PeerProcess:
        peer = self.spawn_peer(extra_args)
        peer.wait_ready(timeout)
        return peer

    def start(self, n_peers: int, timeout: float = 60.0) -> None:
        """Peer 0 first (the others need its address), then the rest side by side."""
        if not self.peers:
            self.add_peer(timeout=timeout)
        joining = [self.spawn_peer() for _ in range(n_peers - len(self.peers))]
        for peer in joining:
            peer.wait_ready(timeout)

    def wait_all_see_each_other(self, timeout: float = 60.0) -> None:
        live = [p for p in self.peers if p.proc.poll() is None]

        def complete() -> bool:
            return all(p.seen_peer_ids() >= {q.peer_id for q in live if q is not p} for p in live)

        wait_for(complete, timeout, f"all {len(live)} peers to list each other")

    def stop(self) -> list[int]:
        codes = []
        for peer in reversed(self.peers):
            codes.append(peer.stop())
        return list(reversed(codes))

    def kill_all(self) -> None:
        for peer in self.peers:
            peer.kill()

    def __enter__(self) -> Self:
        # SIGTERM's default action ends this process without running __exit__, leaving every peer running
        # (`kill` of a benchmark or test run); as an exception it unwinds through __exit__ like Ctrl-C does.
        self._sigterm_installed = threading.current_thread() is threading.main_thread()
        if self._sigterm_installed:
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.kill_all()
        finally:
            if self._sigterm_installed:
                signal.signal(signal.SIGTERM, self._previous_sigterm)


def alive_pids(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie waiting to be reaped does not count)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
