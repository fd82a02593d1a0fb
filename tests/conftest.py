"""Shared fixtures. Every child process a test starts is reaped, also when the test fails. What tests share
besides fixtures is in tests/helpers.py."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import psutil
import pytest

# Nothing in the tests may come from a model or data hub; set before any test (or peer it starts) imports them,
# so a lookup that would go to the network fails at once instead of waiting for a connection.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _no_peerd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's own PEERD_* variables must not leak into tests."""
    for key in list(os.environ):
        if key.startswith("PEERD_"):
            monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def _collect_after_multi_peer_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """A multi-peer test that leaves a connection or a stream open hears of it in its own teardown: the garbage
    collection that finds it would otherwise run in whichever test comes next in this process, and fail that
    one instead."""
    yield
    if request.node.get_closest_marker("integration") is not None:
        gc.collect()


@pytest.fixture(scope="session", autouse=True)
def _reap_leftover_children() -> Iterator[None]:
    yield
    me = psutil.Process()
    leftovers = me.children(recursive=True)
    for child in leftovers:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(leftovers, timeout=10)


def _declared_timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    return float(marker.args[0]) if marker is not None and marker.args else float(item.config.getini("timeout"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules whose tests may run longest go first (by the timeouts they declare; the multi-peer ones before the
    unit tests), each module's tests staying together for its fixtures: with two test processes, a long test
    left for the end would keep one busy while the other idles."""
    longest: dict[str, float] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        longest[module] = max(longest.get(module, 0.0), _declared_timeout(item))

    def key(item: pytest.Item) -> tuple[bool, float]:
        module = item.nodeid.split("::")[0]
        return module.startswith("tests/unit/"), -longest[module]

    items.sort(key=key)  # stable: a module's tests keep their order
