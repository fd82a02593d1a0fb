"""hivemind's DHT node on the daemon's own event loop: how a light peer (no training, no experts) runs it.

A trainer keeps hivemind's DHT in a child process (``process.py``), so that DHT traffic never waits on the
Python work of a training step. A light peer has no such work, and the child costs it memory: forked from a
daemon that imported torch, it copies the pages it shares with the daemon as it touches them, and every
request crosses a pipe. Here the same ``DHTNode`` (hivemind's, with the same options and validators)
runs beside the daemon's tasks instead, with the surface of ``hivemind.DHT`` that ``SwarmNode`` uses.

p2pd is then the daemon's own child, which needs what the DHT child gave it: a process group of its own, so
that a Ctrl-C in the terminal reaches only the daemon (which announces ``leaving`` through p2pd before
stopping it), and death with the daemon if the daemon is killed. ``p2pd_exec.py`` sets both, then becomes p2pd.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from hivemind.dht.node import DHTNode
from hivemind.dht.validation import CompositeValidator, RecordValidatorBase
from hivemind.p2p import P2P
from multiaddr import Multiaddr

__all__ = ["InProcessDHT"]

T = TypeVar("T")
EXEC_SHIM = Path(__file__).with_name("p2pd_exec.py")
P2P_OPTIONS = frozenset(inspect.signature(P2P.create).parameters)


class InProcessDHT:
    """A running ``DHTNode`` and the p2pd it started; requests return asyncio futures (as ``hivemind.DHT``'s
    return ``MPFuture``\\ s, which ``SwarmNode`` awaits the same way)."""

    def __init__(self, node: DHTNode, p2p: P2P, visible_maddrs: list[Multiaddr]) -> None:
        self.node = node
        self.p2p = p2p
        self.peer_id = p2p.peer_id
        self._visible_maddrs = visible_maddrs
        self._closed = False

    @classmethod
    async def create(cls, initial_peers: list[str], record_validators: Iterable[RecordValidatorBase],
                     p2pd_flags: Mapping[str, int | str], **kwargs: Any) -> InProcessDHT:
        """``kwargs``: what ``hivemind.DHT`` takes, for ``DHTNode.create`` and ``P2P.create`` both."""
        p2p_kwargs = {name: value for name, value in kwargs.items() if name in P2P_OPTIONS}
        node_kwargs = {name: value for name, value in kwargs.items() if name not in P2P_OPTIONS}
        p2p = await _p2p_class(p2pd_flags).create(initial_peers=initial_peers, **p2p_kwargs)
        try:
            node = await DHTNode.create(p2p=p2p, initial_peers=initial_peers,
                                        record_validator=CompositeValidator(list(record_validators)), **node_kwargs)
            visible = await p2p.get_visible_maddrs()
        except BaseException:
            await p2p.shutdown()
            raise
        return cls(node, p2p, visible)

    def store(self, key: str, value: Any, expiration_time: float, subkey: Any = None,
              return_future: bool = True, **kwargs: Any) -> asyncio.Future[Any]:
        """``kwargs``: as ``DHTNode.store`` takes them (e.g. ``beam_size``)."""
        return self._detached(self.node.store(key, value, expiration_time, subkey=subkey, **kwargs))

    def get(self, key: str, latest: bool = False, return_future: bool = True, **kwargs: Any) -> asyncio.Future[Any]:
        """``kwargs``: as ``DHTNode.get`` takes them (e.g. ``beam_size``)."""
        return self._detached(self.node.get(key, latest=latest, **kwargs))

    def run_coroutine(self, coroutine: Callable[[InProcessDHT, DHTNode], Awaitable[Any]],
                      return_future: bool = True) -> asyncio.Future[Any]:
        return self._detached(coroutine(self, self.node))

    def get_visible_maddrs(self) -> list[Multiaddr]:
        """As p2pd reported them at start (a relayed address comes later, through ``Reachability``)."""
        return list(self._visible_maddrs)

    def is_alive(self) -> bool:
        child = getattr(self.p2p, "_child", None)  # hivemind keeps p2pd's process here
        return not self._closed and self.p2p.is_alive and (child is None or child.returncode is None)

    async def replicate_p2p(self) -> P2P:
        """A second hivemind handle to the same p2pd, as ``hivemind.DHT`` gives: closing it leaves p2pd up."""
        return await P2P.replicate(self.p2p.daemon_listen_maddr)

    async def close(self) -> None:
        """Stops the DHT node, then p2pd."""
        self._closed = True
        try:
            await self.node.shutdown()
        finally:
            await self.p2p.shutdown()

    @staticmethod
    def _detached(request: Awaitable[T]) -> asyncio.Future[T]:
        # As with the DHT child, a caller that stops waiting (a timeout) does not cancel the request itself:
        # a store that timed out still lands. hivemind bounds each request by its own wait_timeout.
        return asyncio.shield(asyncio.ensure_future(request))


def _p2p_class(flags: Mapping[str, int | str]) -> type[P2P]:
    """hivemind's P2P, whose p2pd starts through ``p2pd_exec.py`` with ``-name=value`` for each of ``flags``
    after hivemind's own (``P2P.create`` has no parameter for them)."""
    build = P2P._make_process_args

    def process_args(*args: Any, **kwargs: Any) -> list[str]:
        command = [*build(*args, **kwargs), *(f"-{name}={value}" for name, value in flags.items())]
        return [sys.executable, "-I", "-S", str(EXEC_SHIM), *command]

    return type("PeerdP2P", (P2P,), {"_make_process_args": staticmethod(process_args)})
