"""Shared fixtures. Every child process a test starts is reaped, also when the test fails. What tests share
besides fixtures is in tests/helpers.py."""

from __future__ import annotations

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
