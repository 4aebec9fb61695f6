"""The package's layer order, as docs/design.md draws it, holds for every import in outcore/.

The order is read from the ``layers`` block of docs/design.md (top layer first), so the page
and this check cannot drift apart. A module may import its own layer and the layers below;
type-only imports (under ``TYPE_CHECKING``) obey the same rule. Imports inside functions are
allowed only where the page says why (the CLI's start-up time, optional extras), and must
point down as well. The modules' own import graph has no cycle, and no file under outcore/
grows past 500 lines.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "outcore"
DESIGN = ROOT / "docs" / "design.md"
MAX_LINES = 500


def _layers() -> list[list[str]]:
    """The ``layers`` block of docs/design.md: one layer per line, top first, each line the
    layer's packages or modules (``#`` starts a comment)."""
    text = DESIGN.read_text()
    match = re.search(r"```text title=\"layers\"\n(.*?)```", text, re.S)
    assert match, "docs/design.md has no ```text title=\"layers\" block"
    rows = [line.split("#")[0].split() for line in match.group(1).splitlines()]
    return [row for row in rows if row]


def _lazy_allowed() -> set[str]:
    """Modules the page allows function-level imports in (its ``lazy imports`` list)."""
    match = re.search(r"```text title=\"lazy-imports\"\n(.*?)```", DESIGN.read_text(), re.S)
    assert match, "docs/design.md has no ```text title=\"lazy-imports\" block"
    return {line.split("#")[0].strip() for line in match.group(1).splitlines()} - {""}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    where: str  # "top", "type" (under TYPE_CHECKING) or "function"


def _target(source: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = source.split(".")
        if MODULES[source].name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([node.module] if node.module else [])])
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _imports(source: str) -> list[Import]:
    tree = ast.parse(MODULES[source].read_text())
    found: list[Import] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(Import(source, t, child.lineno, where)
                             for t in _target(source, child) if t.startswith("outcore"))
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, "type")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "function")
            else:
                visit(child, where)

    visit(tree, "top")
    return found


ALL_IMPORTS = [imp for name in sorted(MODULES) for imp in _imports(name)]


def _layer_of(module: str, layers: list[list[str]]) -> int:
    """Index of ``module``'s layer (0 = top): the longest listed name it is or lies under."""
    best, index = "", -1
    for i, row in enumerate(layers):
        for name in row:
            full = name if name == "outcore" else f"outcore.{name}"
            if (module == full or module.startswith(full + ".")) and len(full) > len(best):
                best, index = full, i
    return index


def test_every_module_has_a_layer() -> None:
    layers = _layers()
    missing = [m for m in MODULES if _layer_of(m, layers) < 0]
    assert not missing, f"modules in no layer of docs/design.md: {missing}"


def _upward(imports: list[Import], layers: list[list[str]]) -> list[str]:
    """The imports whose target sits in a higher layer than their source."""
    return [f"{i.source}:{i.line} imports {i.target} ({i.where})" for i in imports
            if _layer_of(i.target, layers) < _layer_of(i.source, layers)]


def test_every_import_points_down() -> None:
    upward = _upward(ALL_IMPORTS, _layers())
    assert not upward, "imports that point up the layer order:\n" + "\n".join(upward)


def test_imports_inside_functions_only_where_the_page_says() -> None:
    allowed = _lazy_allowed()
    lazy = [f"{i.source}:{i.line} imports {i.target}" for i in ALL_IMPORTS
            if i.where == "function" and i.source not in allowed]
    assert not lazy, "imports inside functions (move them to the top):\n" + "\n".join(lazy)


def test_the_module_graph_has_no_cycle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in ALL_IMPORTS:
        if i.where == "top" and i.target in MODULES and i.target != i.source:
            graph[i.source].add(i.target)
    done: set[str] = set()

    def walk(node: str, path: list[str]) -> None:
        if node in path:
            cycle = path[path.index(node):] + [node]
            # a package's __init__ importing its own submodules is how re-exports work
            if not all(c.startswith(cycle[0]) or cycle[0].startswith(c) for c in cycle):
                pytest.fail("import cycle: " + " -> ".join(cycle))
            return
        if node in done:
            return
        for nxt in sorted(graph[node]):
            walk(nxt, [*path, node])
        done.add(node)

    for module in sorted(graph):
        walk(module, [])


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_files_stay_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines (at most {MAX_LINES})"


def test_the_check_sees_an_upward_import() -> None:
    """The checker itself: of a downward, a sideways and an upward import (also one only for
    the type checker), it reports the upward ones."""
    layers = _layers()
    imports = [Import("outcore.engine.core", "outcore.config.schema", 1, "top"),
               Import("outcore.zero.group", "outcore.zero.param", 2, "top"),
               Import("outcore.config.schema", "outcore.engine.core", 3, "function"),
               Import("outcore.offload.storage", "outcore.zero.param", 4, "type")]
    assert _upward(imports, layers) == [
        "outcore.config.schema:3 imports outcore.engine.core (function)",
        "outcore.offload.storage:4 imports outcore.zero.param (type)"]
