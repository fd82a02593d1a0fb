"""The floor plan holds: every import in peerd/ points down the floors of docs/architecture.md, nothing imports
in a circle, and no module grows past MAX_LINES.

The floors are read from the page itself (its block under "## Floors"), so the page and the code cannot drift:
a unit (a module or package directly under peerd/) may import the units listed below it in that block, on its
floor or a lower one, never one listed above it. Imports are read with ``ast``, wherever they stand: at the top,
inside a function, under ``if TYPE_CHECKING:``.

- The floor check counts every import. One made only for type checking still means that the lower floor knows
  the higher one's types: its signatures change when the higher floor does.
- The circle check leaves out imports under ``if TYPE_CHECKING:``: they never run, so they cannot take part in
  an import-time circle, and naming a collaborator's type in an annotation is what they are for. A
  function-level import counts: it runs, and a circle that works only because of call order is still a circle.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "peerd"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# sides of one package that must not import each other in either direction
INDEPENDENT = [("peerd.experts.client", "peerd.experts.server")]
MAX_LINES = 300  # a module longer than this holds more than one thing: split it along a seam

pytestmark = pytest.mark.timeout(60)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the most specific module of peerd the statement names
    line: int
    typing_only: bool  # under `if TYPE_CHECKING:`

    def __str__(self) -> str:
        return f"{self.source} (line {self.line}) imports {self.target}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def statements(tree: ast.AST, typing_only: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement below ``tree``, with whether it runs only for the type checker."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, typing_only
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.body:
                yield from statements(ast.Module(body=[child], type_ignores=[]), True)
            for child in node.orelse:
                yield from statements(ast.Module(body=[child], type_ignores=[]), typing_only)
        else:
            yield from statements(node, typing_only)


def imports_of(name: str, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node, typing_only in statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [resolve(alias.name) for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from peerd.x import y` names the module peerd.x.y if there is one, else a name of peerd.x
            targets = [resolve(f"{base}.{alias.name}") for alias in node.names]
        for target in targets:
            if target is not None and target != name:
                yield Import(name, target, node.lineno, typing_only)


def all_imports() -> list[Import]:
    known = all_modules()
    return [found for name, path in known.items() for found in imports_of(name, path, known)]


def unit_of(module: str) -> str:
    """The unit a module belongs to: ``peerd.x`` for peerd/x.py and everything in peerd/x/; ``peerd`` for
    peerd/__init__.py."""
    return ".".join(module.split(".")[:2])


def floor_plan() -> list[tuple[int, str]]:
    """(floor, unit) from docs/architecture.md's floor block, bottom of the page first."""
    block = ARCHITECTURE.read_text().split("## Floors", 1)[1].split("```", 2)[1]
    plan, floor = [], 0
    for line in block.splitlines():
        if match := re.match(r"floor (\d+)\s", line):
            floor = int(match.group(1))
        for path in re.findall(r"\bpeerd/[A-Za-z_]+(?:\.py|/)", line):
            unit = path.removesuffix("/").removesuffix(".py").replace("/", ".")
            plan.append((floor, "peerd" if unit == "peerd.__init__" else unit))
    return plan[::-1]


def ranks() -> dict[str, int]:
    plan = floor_plan()
    units = [unit for _, unit in plan]
    assert len(units) == len(set(units)), f"a unit is listed twice on the floor plan: {units}"
    floors = [floor for floor, _ in plan]
    assert floors == sorted(floors), f"the floor plan lists its floors out of order: {plan}"
    return {unit: rank for rank, unit in enumerate(units)}


def test_the_floor_plan_names_every_unit_of_the_package() -> None:
    units = {unit_of(name) for name in all_modules()}
    listed = set(ranks())
    assert not units - listed, f"not on the floor plan of docs/architecture.md: {sorted(units - listed)}"
    assert not listed - units, f"on the floor plan but not in peerd/: {sorted(listed - units)}"


def test_every_import_points_down_the_floors() -> None:
    rank = ranks()
    upward = [
        f"{found} ({unit_of(found.target)} is above {unit_of(found.source)})"
        for found in all_imports()
        if unit_of(found.source) != unit_of(found.target) and rank[unit_of(found.target)] > rank[unit_of(found.source)]
    ]
    assert not upward, "imports pointing up the floors:\n" + "\n".join(upward)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_in_a_circle() -> None:
    edges: dict[str, set[str]] = {}
    for found in all_imports():
        if not found.typing_only:
            edges.setdefault(found.source, set()).add(found.target)
    assert not cycles(edges), f"import circles: {cycles(edges)}"


def child_of(package: str, module: str) -> str | None:
    """The direct child of ``package`` (module or subpackage) that ``module`` is or lies in."""
    if not module.startswith(package + "."):
        return None
    return f"{package}.{module[len(package) + 1:].split('.')[0]}"


def test_no_two_parts_of_a_package_import_each_other_in_a_circle() -> None:
    """Within every package, its modules and subpackages (each taken whole) import one way only."""
    imports = [found for found in all_imports() if not found.typing_only]
    packages = [name for name, path in all_modules().items() if path.name == "__init__.py"]
    circles = []
    for package in packages:
        edges: dict[str, set[str]] = {}
        for found in imports:
            source, target = child_of(package, found.source), child_of(package, found.target)
            if source is not None and target is not None and source != target:
                edges.setdefault(source, set()).add(target)
        circles += cycles(edges)
    assert not circles, f"parts of a package that import each other: {circles}"


@pytest.mark.parametrize(("one", "other"), INDEPENDENT)
def test_independent_sides_never_import_each_other(one: str, other: str) -> None:
    crossing = [
        str(found)
        for found in all_imports()
        if (found.source.startswith(one) and found.target.startswith(other))
        or (found.source.startswith(other) and found.target.startswith(one))
    ]
    assert not crossing, "\n".join(crossing)


def test_the_checks_see_function_level_and_type_checking_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import peerd.errors\n"
        "if TYPE_CHECKING:\n"
        "    from peerd.config import PeerdConfig\n"
        "def f() -> None:\n"
        "    from peerd.swarm import node\n"
    )
    tree = ast.parse(source)
    found = [(node.lineno, typing_only) for node, typing_only in statements(tree)]
    assert found == [(1, False), (2, False), (4, True), (6, False)]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_longer_than_the_limit() -> None:
    long = {name: n for name, path in all_modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
