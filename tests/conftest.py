"""Shared fixtures. Every child process a test starts is reaped, also when the test fails."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# Nothing in the tests may come from a model or data hub; set before any test (or peer it starts) imports them,
# so a lookup that would go to the network fails at once instead of waiting for a connection.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
LOCAL_CONFIG = REPO / "configs" / "local.yaml"


def model_in_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """The model's state_dict entries in a peerd checkpoint file (its ``model/<key>`` tensors)."""
    tensors = torch.load(path, weights_only=True)["tensors"]
    return {name.removeprefix("model/"): t for name, t in tensors.items() if name.startswith("model/")}


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
