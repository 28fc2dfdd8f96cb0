"""No import circle in ``pagedllm/``: the import graph, walked from the source, has no cycle.

What counts as an import (every statement, also inside functions and under
``if TYPE_CHECKING:``; relative imports resolved) is documented in ``tests/import_graph.py``.
"""
from __future__ import annotations

from pathlib import Path

from tests.import_graph import describe_cycle, import_graph, shortest_cycle, strongly_connected


def test_pagedllm_has_no_import_cycle() -> None:
    graph = import_graph()
    cycles = [describe_cycle(graph, shortest_cycle(graph, component[0]))
              + f"\n    (modules on a circle together: {', '.join(component)})"
              for component in strongly_connected(graph)]
    assert not cycles, "import cycles in pagedllm/:\n  " + "\n  ".join(cycles)


def test_the_walk_reaches_imports_in_functions_and_type_checking_blocks() -> None:
    graph = import_graph()
    assert "pagedllm.entrypoints.bench.memory" in graph["pagedllm.entrypoints.cli"]  # inside a function
    assert "pagedllm.entrypoints.llm" in graph["pagedllm.entrypoints.bench.throughput"]  # TYPE_CHECKING only
    assert "pagedllm.platform" in graph["pagedllm.engine.arg_resolve"]  # `from pagedllm import platform`


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_a_cycle_through_every_kind_of_import_is_found(tmp_path: Path) -> None:
    package = _write(tmp_path, {
        "pkg/__init__.py": "",
        # a function-level `from <package> import <submodule>`
        "pkg/a.py": "def f():\n    from pkg import b\n    return b\n",
        # a relative import under TYPE_CHECKING
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.c import X\n",
        "pkg/sub/__init__.py": "from . import c\n",
        # two levels up, a name that is not a module: the edge goes to the module holding it
        "pkg/sub/c.py": "try:\n    from ..a import f\nexcept ImportError:\n    f = None\nX = 1\n",
        "pkg/d.py": "import os\nimport pkg.sub\nfrom pkg import VERSION\n",
    })
    graph = import_graph(package)
    assert graph == {
        "pkg": {}, "pkg.a": {"pkg.b": 2}, "pkg.b": {"pkg.sub.c": 3}, "pkg.sub": {"pkg.sub.c": 1},
        "pkg.sub.c": {"pkg.a": 2}, "pkg.d": {"pkg.sub": 2, "pkg": 3},
    }
    assert strongly_connected(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    cycle = shortest_cycle(graph, "pkg.a")
    assert cycle == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    assert describe_cycle(graph, cycle) == (
        "pkg.a -> pkg.b (line 2 of pkg.a) -> pkg.sub.c (line 3 of pkg.b) -> pkg.a (line 2 of pkg.sub.c)")


def test_a_module_importing_itself_is_a_cycle_and_a_chain_is_not(tmp_path: Path) -> None:
    package = _write(tmp_path, {
        "pkg/__init__.py": "from pkg import one\n",
        "pkg/one.py": "import pkg.two\n",
        "pkg/two.py": "from pkg import two\n",
    })
    graph = import_graph(package)
    assert strongly_connected(graph) == [["pkg.two"]]
    assert shortest_cycle(graph, "pkg.two") == ["pkg.two", "pkg.two"]
    assert shortest_cycle(graph, "pkg.one") == []
