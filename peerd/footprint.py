"""Keeps a daemon process small; applied by `peerd start` before anything imports hivemind.

Two things cost memory in every peer without serving peerd (the measurements, taken on a light peer with
``benchmarks/bench_light.py``, are on the benchmarks page, "Memory per peer"):

- hivemind's package ``__init__`` imports its averager, optimizer and MoE server (with scipy), although peerd
  only uses ``hivemind.dht``, ``hivemind.p2p`` and ``hivemind.utils``: heap every daemon holds, and the forked
  DHT child inherits. The package is registered without running its ``__init__``; its submodules import as
  usual, and the first attribute asked of the package itself (``hivemind.DHT``) runs the real ``__init__``
  then, so nothing that wants the full package breaks.
- hivemind's MPFuture (every DHT request's future) keeps its state in a torch tensor in shared memory, with
  torch's ``file_system`` sharing strategy by default, which starts a ``torch_shm_manager`` process (it links
  all of libtorch). With ``file_descriptor`` the same tensors are shared as file descriptors and no manager
  process runs; hivemind reads the strategy from its own environment variable.

And p2pd (Go, started by the DHT child with this environment) holds a live heap from its start that, with Go's
default GOGC=100, grows to twice its size before a collection. GOGC=50 (25 on a light peer, which moves no
gradients) keeps it smaller for a little more collector time.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Any

__all__ = ["is_lean", "lean_hivemind"]

SHARING_STRATEGY_VARIABLE = "HIVEMIND_MEMORY_SHARING_STRATEGY"


def lean_hivemind(light: bool = False) -> None:
    """Registers ``hivemind`` as a lazy package, picks the sharing strategy that needs no manager process and
    p2pd's garbage collector target (``light``: a peer that neither trains nor serves experts).

    The package part does nothing if hivemind was already imported (its ``__init__`` has run) or cannot be
    found; ``HIVEMIND_MEMORY_SHARING_STRATEGY`` or ``GOGC`` set in the environment win.
    """
    os.environ.setdefault(SHARING_STRATEGY_VARIABLE, "file_descriptor")
    os.environ.setdefault("GOGC", "25" if light else "50")
    if "hivemind" in sys.modules:
        return
    spec = importlib.util.find_spec("hivemind")
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    package = importlib.util.module_from_spec(spec)  # created, not executed
    loader = spec.loader
    running = False

    def full_package(name: str) -> Any:
        nonlocal running
        submodule = sys.modules.get(f"hivemind.{name}")
        if submodule is not None:  # `import hivemind.p2p.x as y` asks for a half-imported subpackage
            return submodule
        if running or name.startswith("__"):  # dunder probes (copy, pickle, doctest) must not load it all
            raise AttributeError(name)
        running = True
        loader.exec_module(package)
        del package.__getattr__  # the package is whole now: normal attribute lookup from here on
        return getattr(package, name)

    package.__getattr__ = full_package  # type: ignore[method-assign]
    sys.modules["hivemind"] = package


def is_lean(module: types.ModuleType) -> bool:
    """True while ``module`` (hivemind) is registered but its ``__init__`` has not run."""
    return hasattr(module, "__getattr__") and "DHT" not in vars(module)
