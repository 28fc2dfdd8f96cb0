"""The import graph of a package, read from its source with ``ast`` (nothing is imported).

Every import statement counts wherever it stands: at module level, inside functions and
methods, in ``try`` blocks and under ``if TYPE_CHECKING:``. Type-only imports are counted on
purpose (the stricter choice): two modules that name each other's types depend on each other,
and ``typing.get_type_hints`` or a later edit that drops the guard turns such a circle into a
run-time one. Names are resolved as Python would:

- ``import a.b.c`` depends on ``a.b.c``;
- ``from a.b import c`` depends on ``a.b.c`` when that is a module, else on ``a.b``;
- relative imports (``from . import x``, ``from ..core import y``) are made absolute first.

Parent packages that Python runs on the way (``a`` and ``a.b`` for ``import a.b.c``) are not
edges: every module would then depend on its package's ``__init__``, and a package that
re-exports its submodules would be a circle with each of them. Imports by string
(``importlib.import_module(name)``, the lazy registries) are not followed.
"""
from __future__ import annotations

import ast
from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagedllm"
"""The package the project's tests walk."""


@dataclass(frozen=True)
class Import:
    """One imported name, made absolute, and the line of the statement that imports it."""

    target: str
    line: int


def package_modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file under ``package``."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _relative_base(module: str, path: Path, level: int, name: str | None) -> str:
    """The absolute module that ``from <level dots><name> import ...`` in ``module`` names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    parts = package.split(".")
    assert level - 1 < len(parts), f"{path}: relative import beyond the top-level package"
    base = ".".join(parts[:len(parts) - (level - 1)])
    return f"{base}.{name}" if name else base


def _targets(node: ast.Import | ast.ImportFrom, module: str, path: Path,
             modules: Collection[str]) -> Iterator[str]:
    """The absolute names one import statement depends on."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = _relative_base(module, path, node.level, node.module) if node.level else node.module
    assert base, f"{path}:{node.lineno}: an import from nowhere"
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        yield submodule if submodule in modules else base


def imports_of(module: str, path: Path, modules: Collection[str]) -> list[Import]:
    """Every name ``module`` (source ``path``) imports, anywhere in it, internal or not."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found += [Import(target, node.lineno) for target in _targets(node, module, path, modules)]
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """Module -> {module of the same package it imports: line of the first such import}."""
    modules = package_modules(package)
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for imp in imports_of(module, path, modules):
            if imp.target in modules:
                edges.setdefault(imp.target, imp.line)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components that hold a circle (two or more modules, or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, {}):
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def shortest_cycle(graph: dict[str, dict[str, int]], start: str) -> list[str]:
    """The shortest circle from ``start`` back to it, as [start, ..., start]; [] if there is none."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in graph.get(node, {}):
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if succ not in came_from:
                came_from[succ] = node
                queue.append(succ)
    return []


def describe_cycle(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    """``a -> b (line 12 of a) -> a (line 3 of b)``: each step with the line that imports it."""
    steps = [cycle[0]]
    for here, there in zip(cycle, cycle[1:]):
        steps.append(f"{there} (line {graph[here][there]} of {here})")
    return " -> ".join(steps)
