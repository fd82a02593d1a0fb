"""Every test file in tests/integration/ (real processes, real p2pd) declares ``pytestmark`` with
``pytest.mark.integration``, so ``-m "not integration"`` runs the fast tests alone and none of the slow ones
slips in unmarked."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"

pytestmark = pytest.mark.timeout(30)


def marks(path: Path) -> list[str]:
    """The dotted names of the marks a module's ``pytestmark`` assignment holds (``pytest.mark.timeout(120)``
    gives ``pytest.mark.timeout``)."""
    found = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, ast.List | ast.Tuple) else [node.value]
            for value in values:
                found.append(ast.unparse(value.func if isinstance(value, ast.Call) else value))
    return found


def test_every_integration_test_file_is_marked() -> None:
    files = sorted(INTEGRATION.glob("test_*.py"))
    assert files, f"no test files found in {INTEGRATION}"
    unmarked = [path.name for path in files if "pytest.mark.integration" not in marks(path)]
    assert not unmarked, f"add `pytestmark = pytest.mark.integration` to {unmarked}"


def test_marks_are_read_from_single_marks_and_lists(tmp_path: Path) -> None:
    single = tmp_path / "single.py"
    single.write_text("import pytest\npytestmark = pytest.mark.integration\n")
    listed = tmp_path / "listed.py"
    listed.write_text("import pytest\npytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]\n")
    other = tmp_path / "other.py"
    other.write_text("import pytest\npytestmark = pytest.mark.timeout(120)\n")
    assert marks(single) == ["pytest.mark.integration"]
    assert marks(listed) == ["pytest.mark.integration", "pytest.mark.timeout"]
    assert marks(other) == ["pytest.mark.timeout"]
