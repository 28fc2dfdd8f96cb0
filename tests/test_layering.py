"""DESIGN.md's layering: lower layers never import higher ones; core/ imports no torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagedllm"

#: Top-level module or sub-package of pagedllm -> layer (DESIGN.md: L0 ... L8).
LAYERS = {
    "config": 0, "platform": 0, "sampling_params": 0, "request": 0, "outputs": 0, "errors": 0,
    "core": 1, "distributed": 2, "layers": 3, "attention": 3, "models": 4, "worker": 5,
    "executor": 6, "engine": 7, "entrypoints": 8,
}


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "pagedllm" or len(parts) < 2:
        return None
    return LAYERS[parts[1]]


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path))
    return out


def test_every_module_has_a_layer() -> None:
    for module, _ in _modules():
        if module != "pagedllm":
            assert _layer_of(module) is not None, f"{module} is in no layer of DESIGN.md"


def test_no_module_imports_a_higher_layer() -> None:
    violations = []
    for module, path in _modules():
        own = _layer_of(module)
        if own is None:  # the package's lazy public facade
            continue
        for imported in _imports(path):
            other = _layer_of(imported)
            if other is not None and other > own:
                violations.append(f"{module} (L{own}) imports {imported} (L{other})")
    assert not violations, "\n".join(violations)


def test_entrypoints_see_only_engine_and_l0() -> None:
    for module, path in _modules():
        if _layer_of(module) != 8:
            continue
        for imported in _imports(path):
            layer = _layer_of(imported)
            assert layer in (None, 0, 7, 8), f"{module} imports {imported} (L{layer})"


def test_core_imports_no_torch() -> None:
    for module, path in _modules():
        if module.startswith("pagedllm.core") or _layer_of(module) == 0:
            assert not any(i == "torch" or i.startswith("torch.") for i in _imports(path)), module
    # and at run time: importing the scheduler must not pull torch in through anything
    code = "import sys, pagedllm.core.scheduler; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)
