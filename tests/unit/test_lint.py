"""The repository stays lint-clean and type-checks: ruff (rules in pyproject.toml) over everything, mypy --strict
over the package. Both are pinned in the test extra, so a new release cannot change what passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=280,
                          check=False)


@pytest.mark.timeout(300)
def test_ruff_finds_nothing() -> None:
    result = run_tool("ruff", "check", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(300)
def test_mypy_strict_finds_nothing_in_the_package() -> None:
    result = run_tool("mypy", "peerd")
    assert result.returncode == 0, result.stdout + result.stderr
