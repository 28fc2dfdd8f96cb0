"""The layering of docs/STRUCTURE.md (the project's DESIGN.md, kept outside this tree, draws the same layers):
lower layers never import higher ones; core/ imports no torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.import_graph import imports_of, package_modules

#: Top-level module or sub-package of pagedllm -> layer (docs/STRUCTURE.md: L0 ... L8).
LAYERS = {
    "config": 0, "envs": 0, "platform": 0, "sampling_params": 0, "request": 0, "outputs": 0, "errors": 0,
    "lora_request": 0, "pooling_params": 0, "prompt_embeds": 0,
    "core": 1, "distributed": 2, "layers": 3, "attention": 3, "lora": 3, "models": 4, "worker": 5, "spec_decode": 5,
    "executor": 6, "engine": 7, "entrypoints": 8,
}

MODULES = package_modules()
"""Every module of pagedllm -> its source file."""

#: Entrypoints see only the engine and L0 ...
ENTRYPOINT_LAYERS = frozenset({0, 7, 8})
#: ... except these packages, which may also use the named lower layers directly.
ENTRYPOINT_EXCEPTIONS = {
    "pagedllm.entrypoints.bench": frozenset({1}),  # the memory simulator replays core/'s Scheduler
}


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "pagedllm" or len(parts) < 2:
        return None
    return LAYERS[parts[1]]


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _entrypoint_may_use(module: str, layer: int | None) -> bool:
    """Whether the entrypoints module ``module`` may import a module of ``layer`` (None: not pagedllm's)."""
    allowed = set(ENTRYPOINT_LAYERS)
    for package, extra in ENTRYPOINT_EXCEPTIONS.items():
        if _in_package(module, package):
            allowed |= extra
    return layer is None or layer in allowed


def _imports(module: str, path: Path) -> list[str]:
    """Every name ``module`` imports: anywhere in the file, relative ones made absolute."""
    return [imp.target for imp in imports_of(module, path, MODULES)]


def _modules() -> list[tuple[str, Path]]:
    return list(MODULES.items())


def test_every_module_has_a_layer() -> None:
    for module, _ in _modules():
        if module != "pagedllm":
            assert _layer_of(module) is not None, f"{module} is in no layer of docs/STRUCTURE.md"


def test_no_module_imports_a_higher_layer() -> None:
    violations = []
    for module, path in _modules():
        own = _layer_of(module)
        if own is None:  # the package's lazy public facade
            continue
        for imported in _imports(module, path):
            other = _layer_of(imported)
            if other is not None and other > own:
                violations.append(f"{module} (L{own}) imports {imported} (L{other})")
    assert not violations, "\n".join(violations)


def test_entrypoints_see_only_engine_and_l0_and_bench_also_core() -> None:
    for module, path in _modules():
        if _layer_of(module) != 8:
            continue
        for imported in _imports(module, path):
            layer = _layer_of(imported)
            assert _entrypoint_may_use(module, layer), f"{module} imports {imported} (L{layer})"


def test_only_bench_may_use_core_among_the_entrypoints() -> None:
    bench = "pagedllm.entrypoints.bench"
    assert _entrypoint_may_use(bench, 1) and _entrypoint_may_use(f"{bench}.memory_sim.paged", 1)
    for other in ("pagedllm.entrypoints.llm", "pagedllm.entrypoints.cli", "pagedllm.entrypoints.openai.serving",
                  "pagedllm.entrypoints.benchmarks"):  # a name that only starts like bench is not in it
        assert not _entrypoint_may_use(other, 1), other
    for layer in (2, 3, 4, 5, 6):  # bench sees nothing else below the engine
        assert not _entrypoint_may_use(f"{bench}.memory", layer), layer
    # the exception is in use: the simulator does import core/ directly
    assert any(_layer_of(imported) == 1 for module, path in _modules() if _in_package(module, bench)
               for imported in _imports(module, path))


def test_core_imports_no_torch() -> None:
    for module, path in _modules():
        if module.startswith("pagedllm.core") or _layer_of(module) == 0:
            assert not any(i == "torch" or i.startswith("torch.") for i in _imports(module, path)), module
    # and at run time: importing the scheduler must not pull torch in through anything
    code = "import sys, pagedllm.core.scheduler; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _functions_stepping_a_core_in_a_loop() -> set[str]:
    """Every function of pagedllm with a ``while`` loop that calls ``<x>.core.step()``, ``self.core.step()`` or
    ``core.step()`` (directly, or through a method of its own class that does)."""
    found = set()
    for module, path in _modules():
        tree = ast.parse(Path(path).read_text())
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)] + [tree]:
            methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
            stepping = {name for name, f in methods.items() if any(_calls_core_step(n) for n in ast.walk(f))}
            for name, f in methods.items():
                for loop in (n for n in ast.walk(f) if isinstance(n, ast.While)):
                    calls = [n for n in ast.walk(loop) if isinstance(n, ast.Call)]
                    if any(_calls_core_step(c) for c in calls) or any(
                            isinstance(c.func, ast.Attribute) and c.func.attr in stepping
                            and isinstance(c.func.value, ast.Name) and c.func.value.id == "self" for c in calls):
                        found.add(f"{module}.{getattr(cls, 'name', '')}.{name}")
    return found


def _calls_core_step(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step"):
        return False
    target = node.func.value
    return (isinstance(target, ast.Name) and target.id == "core") or (
        isinstance(target, ast.Attribute) and target.attr == "core")


def test_one_class_runs_the_step_loop_and_both_server_modes_use_it() -> None:
    """One busy loop steps an engine core (engine/core_loop.py); the thread mode (ThreadClient) and the core
    process (core_proc.main) both run that class, and nothing else loops over a core's step."""
    import inspect

    from pagedllm.engine import core_client, core_proc
    from pagedllm.engine.core_loop import EngineCoreLoop

    assert _functions_stepping_a_core_in_a_loop() == {"pagedllm.engine.core_loop.EngineCoreLoop.run"}
    assert "EngineCoreLoop(" in inspect.getsource(core_client.ThreadClient.__init__)
    assert "loop.run()" in inspect.getsource(core_proc.main) and "EngineCoreLoop(" in inspect.getsource(core_proc.main)
    assert "target=self._loop.run" in inspect.getsource(core_client.ThreadClient.start)
    # the front end reaches a core only through a client: it never imports the core's loop, process or class
    for front in ("pagedllm.engine.async_llm", "pagedllm.engine.llm_engine"):
        imported = set(_imports(front, MODULES[front]))
        assert not imported & {"pagedllm.engine.core_loop", "pagedllm.engine.core_proc"}, front
    assert issubclass(core_client.ThreadClient, core_client.AsyncCoreClient)
    assert issubclass(core_client.MPClient, core_client.AsyncCoreClient)
    assert EngineCoreLoop.run.__qualname__ == "EngineCoreLoop.run"


def test_only_the_platform_layer_tests_for_cuda() -> None:
    """CPU-or-GPU is the platform layer's answer (``platform.is_cuda``, ``platform.is_cpu``): no module elsewhere
    compares a device with "cuda" or "cpu" (making a device, ``torch.device("cuda", rank)``, is not a test of one;
    a tuple of allowed option values is not either)."""
    found = []
    for module, path in _modules():
        if _in_package(module, "pagedllm.platform"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                     for op in node.ops):
                operands = [node.left, *node.comparators]
                if any(isinstance(o, ast.Constant) and o.value in ("cuda", "cpu") for o in operands):
                    found.append(f"{path}:{node.lineno}")
    assert not found, "compare devices through platform.is_cuda / is_cpu:\n" + "\n".join(found)


def test_the_gemm_choice_has_one_home() -> None:
    """Which GEMM a bf16 weight runs (PAGEDLLM_GEMM, the amx level) is ``platform.bf16_gemm``'s answer alone: no
    module outside the platform layer reads the switch or compares the level with "amx" (the kernel library of
    a level, layers/cpu_ops.py ``_kernels``, is told its level, not asked for the process's)."""
    found = []
    for module, path in _modules():
        if _in_package(module, "pagedllm.platform"):
            continue
        text = path.read_text()
        if ".gemm ==" in text or ".gemm !=" in text or "switches().gemm" in text:
            found.append(f"{path}: reads PAGEDLLM_GEMM")
        for node in ast.walk(ast.parse(text)):
            asked = isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and \
                getattr(node.left.func, "attr", getattr(node.left.func, "id", None)) in ("active_level", "isa_level")
            if asked and any(isinstance(o, ast.Constant) and o.value == "amx" for o in node.comparators):
                found.append(f"{path}:{node.lineno}: asks the level")
    assert not found, "ask platform.bf16_gemm:\n" + "\n".join(found)


def test_tests_and_benchmarks_reach_workers_through_collective_rpc() -> None:
    """No test or benchmark reaches a worker through the executor's attributes: they ask through
    ``collective_rpc`` or ``LLM.apply_model`` (tests/utils.py ``worker_of``, ``model_of``), as a user would."""
    import re

    root = Path(__file__).resolve().parents[1]
    reach = re.compile(r"\.executor\.worker\b")
    found = [f"{path.relative_to(root)}:{n}" for folder in ("tests", "benchmarks")
             for path in sorted((root / folder).rglob("*.py")) if path != Path(__file__).resolve()
             for n, line in enumerate(path.read_text().splitlines(), 1) if reach.search(line)]
    assert not found, "\n".join(found)
