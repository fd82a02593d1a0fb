"""Keeps a daemon process small; applied by `peerd start` before anything imports hivemind.

Two things cost memory in every peer without serving peerd (the measurements, taken on a light peer with
``benchmarks/bench_light.py``, are on the benchmarks page, "Memory per peer"):

- hivemind's package ``__init__`` imports its averager, optimizer and MoE server (with scipy), although peerd
  only uses ``hivemind.dht``, ``hivemind.p2p`` and ``hivemind.utils``: heap every daemon holds, and the forked
  DHT child inherits. The package is registered without running its ``__init__``; its submodules import as
  usual, and the first attribute asked of the package itself (``hivemind.DHT``) runs the real ``__init__``
  then, so nothing that wants the full package breaks.
- ``hivemind.utils`` and ``hivemind.dht`` import in their ``__init__`` the modules that need torch (MPFuture,
  tensor descriptors, the DHT class that runs a child process), so any DHT or p2p import loaded all of torch:
  most of a light peer's memory. Both are registered the same way, and a name their ``__init__`` takes from a
  submodule is taken from that submodule alone. A light peer (its DHT on the daemon's loop) loads neither torch
  nor numpy; a trainer imports torch anyway.
- hivemind's MPFuture (every DHT request's future) keeps its state in a torch tensor in shared memory, with
  torch's ``file_system`` sharing strategy by default, which starts a ``torch_shm_manager`` process (it links
  all of libtorch). With ``file_descriptor`` the same tensors are shared as file descriptors and no manager
  process runs; hivemind reads the strategy from its own environment variable.

And p2pd (Go, started by the DHT child with this environment) holds a live heap from its start that, with Go's
default GOGC=100, grows to twice its size before a collection. GOGC=50 (25 on a light peer, which moves no
gradients) keeps it smaller for a little more collector time.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
import types
from typing import Any

__all__ = ["is_lean", "lean_hivemind"]

SHARING_STRATEGY_VARIABLE = "HIVEMIND_MEMORY_SHARING_STRATEGY"


def lean_hivemind(light: bool = False) -> None:
    """Registers ``hivemind``, ``hivemind.utils`` and ``hivemind.dht`` as lazy packages, picks the sharing
    strategy that needs no manager process and p2pd's garbage collector target (``light``: a peer that neither
    trains nor serves experts).

    The package part does nothing if hivemind was already imported (its ``__init__`` has run) or cannot be
    found; ``HIVEMIND_MEMORY_SHARING_STRATEGY`` or ``GOGC`` set in the environment win.
    """
    os.environ.setdefault(SHARING_STRATEGY_VARIABLE, "file_descriptor")
    os.environ.setdefault("GOGC", "25" if light else "50")
    if "hivemind" in sys.modules or _lazy_package("hivemind", by_name=False) is None:
        return
    for name in ("hivemind.utils", "hivemind.dht"):
        _lazy_package(name, by_name=True)


def _lazy_package(name: str, by_name: bool) -> types.ModuleType | None:
    """Registers package ``name`` without running its ``__init__``. ``by_name``: a name its ``__init__`` imports
    from a submodule (``from hivemind.utils.timed_storage import get_dht_time``) is taken from that submodule
    alone, if the ``__init__`` does nothing but such imports. Any other attribute runs the real ``__init__``."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.submodule_search_locations is None or spec.origin is None:
        return None
    package = importlib.util.module_from_spec(spec)  # created, not executed
    loader = spec.loader
    sources = _imported_names(spec.origin) if by_name else {}
    running = False

    def attribute(attr: str) -> Any:
        nonlocal running
        submodule = sys.modules.get(f"{name}.{attr}")
        if submodule is not None:  # `import hivemind.p2p.x as y` asks for a half-imported subpackage
            return submodule
        if attr in sources:
            module, original = sources[attr]
            value = getattr(importlib.import_module(module), original)
            setattr(package, attr, value)
            return value
        if running or attr.startswith("__"):  # dunder probes (copy, pickle, doctest) must not load it all
            raise AttributeError(attr)
        running = True
        loader.exec_module(package)
        del package.__getattr__  # the package is whole now: normal attribute lookup from here on
        return getattr(package, attr)

    package.__getattr__ = attribute  # type: ignore[method-assign]
    sys.modules[name] = package
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, package)
    return package


def _imported_names(init_path: str) -> dict[str, tuple[str, str]]:
    """``name -> (module, name there)`` for an ``__init__`` made only of a docstring and ``from x import a``
    statements; empty for any other."""
    with open(init_path, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    names: dict[str, tuple[str, str]] = {}
    for statement in tree.body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue
        if (not isinstance(statement, ast.ImportFrom) or statement.level != 0 or statement.module is None
                or any(alias.name == "*" for alias in statement.names)):
            return {}
        for alias in statement.names:
            names[alias.asname or alias.name] = (statement.module, alias.name)
    return names


def is_lean(module: types.ModuleType) -> bool:
    """True while ``module`` (hivemind) is registered but its ``__init__`` has not run."""
    return hasattr(module, "__getattr__") and "DHT" not in vars(module)
