"""Function length in pagedllm/ (issue 46): no function over 60 lines, and the 90th percentile held where it is
(20 lines: the issue's goal, reached; never raise it)."""
from __future__ import annotations

import ast
from pathlib import Path

import pagedllm

PACKAGE = Path(pagedllm.__file__).parent
MAX_LINES = 60
MAX_P90 = 20


def function_lengths(source: str, where: str = "") -> list[tuple[int, str]]:
    """(lines from ``def`` to the body's last line, decorators not counted; name) of every function and method."""
    return [(node.end_lineno - node.lineno + 1, f"{where}:{node.lineno} {node.name}")
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def all_lengths() -> list[tuple[int, str]]:
    return sorted(length for path in sorted(PACKAGE.rglob("*.py"))
                  for length in function_lengths(path.read_text(), str(path.relative_to(PACKAGE))))


def test_no_function_is_over_60_lines() -> None:
    long = [f"{name}: {n} lines" for n, name in all_lengths() if n > MAX_LINES]
    assert not long, long
    # the count sees nested functions and methods, from def to the body's end
    sample = ("def f():\n    def g():\n        return 1\n    return g\n\n"
              "class C:\n    async def m(self):\n        pass\n")
    assert sorted(n for n, _ in function_lengths(sample)) == [2, 2, 4]


def test_the_90th_percentile_does_not_grow() -> None:
    lengths = [n for n, _ in all_lengths()]
    p90 = lengths[int(0.9 * len(lengths))]
    assert p90 <= MAX_P90, f"p90 of {len(lengths)} functions is {p90} lines (at most {MAX_P90})"
