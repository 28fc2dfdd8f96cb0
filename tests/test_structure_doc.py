"""docs/STRUCTURE.md names every module of pagedllm: by its path under pagedllm/ or by its file name in
backticks, in the row of its layer (a new module without a line there fails here)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pagedllm"


def test_structure_names_every_module() -> None:
    text = (ROOT / "docs" / "STRUCTURE.md").read_text()
    unnamed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py":
            continue
        if relative not in text and f"`{path.name}`" not in text and f"/{path.name}`" not in text:
            unnamed.append(relative)
    assert not unnamed, f"docs/STRUCTURE.md does not name {unnamed}"
