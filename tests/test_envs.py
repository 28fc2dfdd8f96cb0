"""pagedllm.envs is the one reader of PAGEDLLM_* variables: no other module names one, the README's table is
the registry's, and every variable's default parses while a bad value is refused naming it."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pagedllm import envs
from pagedllm.errors import ValidationError
from tests.import_graph import package_modules

NAME = re.compile(r"PAGEDLLM_[A-Z][A-Z0-9_]*")
README = Path(__file__).resolve().parent.parent / "README.md"


def test_only_envs_names_a_variable() -> None:
    """A string that is a variable's name (an os.environ key) appears in pagedllm/envs.py only; others use
    ``envs.X.read()`` (and ``envs.X.name`` in messages)."""
    offenders = []
    for module, path in package_modules().items():
        if module == "pagedllm.envs":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                offenders.append(f"{path}:{node.lineno}: {node.value}")
    assert not offenders, offenders


def readme_table() -> str:
    """The README's table of variables, as the registry renders it."""
    rows = [f"| `{v.name}` | {f'`{v.default}`' if v.default else '(unset)'} | {v.doc} |" for v in envs.VARIABLES]
    return "\n".join(["| variable | default | what it does |", "|---|---|---|", *rows])


def test_the_readme_table_is_the_registry() -> None:
    assert readme_table() in README.read_text(), "README's table differs; paste:\n" + readme_table()


def test_every_variable_is_in_the_registry_once() -> None:
    names = [v.name for v in envs.VARIABLES]
    assert len(names) == len(set(names))
    declared = {v.name for v in vars(envs).values() if isinstance(v, envs.EnvVar)}
    assert declared == set(names)


@pytest.mark.parametrize("var", envs.VARIABLES, ids=lambda v: v.name)
def test_defaults_parse_and_empty_is_unset(var: envs.EnvVar) -> None:
    assert var.read({}) == var.read({var.name: ""}) == var.read({var.name: "  "})


@pytest.mark.parametrize("var, bad", [
    (envs.GEMM, "mkl"), (envs.EXECUTE_MODEL_TIMEOUT_SECONDS, "-1"), (envs.EXECUTE_MODEL_TIMEOUT_SECONDS, "soon"),
    (envs.RAY_PLACEMENT_STRATEGY, "ANYWHERE"), (envs.TRITON_DECODE_SPLITS, "0"),
    (envs.ENABLE_MULTIPROCESSING, "yes"), (envs.ALLOW_RUNTIME_LORA_UPDATING, "maybe"),
    (envs.SAGEMAKER_STATEFUL_SESSIONS, "maybe"),
], ids=lambda x: getattr(x, "name", x))
def test_a_bad_value_names_the_variable(var: envs.EnvVar, bad: str) -> None:
    with pytest.raises(ValidationError) as e:
        var.read({var.name: bad})
    assert e.value.param == var.name and var.name in e.value.message


def test_values() -> None:
    assert envs.FUSED_OPS.read({"PAGEDLLM_FUSED_OPS": "0"}) is False
    assert envs.GEMM.read({"PAGEDLLM_GEMM": " OneDNN "}) == "onednn"
    assert envs.EXECUTE_MODEL_TIMEOUT_SECONDS.read({}) == 300.0
    assert envs.TRITON_DECODE_SPLITS.read({}) is None and envs.TRITON_DECODE_SPLITS.read(
        {"PAGEDLLM_TRITON_DECODE_SPLITS": "4"}) == 4
    assert envs.ALLOW_RUNTIME_LORA_UPDATING.read({"PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) is True
    assert envs.API_KEY.read({"PAGEDLLM_API_KEY": " k "}) == " k "  # a key is taken exactly as given


def environment_reads(source: str) -> list[int]:
    """Lines of ``source`` that read one variable straight from the environment: ``os.environ.get(...)``,
    ``os.environ[...]``, ``os.getenv(...)``, ``... in os.environ`` (copying the environment for a child, or handing
    it to a reader as a mapping, is not a read)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv", "getenv"):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and \
                ast.unparse(node.value) == "os.environ":
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) and \
                any(ast.unparse(c) == "os.environ" for c in node.comparators):
            lines.append(node.lineno)
    return lines


def test_only_envs_reads_a_variable() -> None:
    """Every variable pagedllm reads, its own or another program's (RAY_ADDRESS, CXX, TRITON_INTERPRET ...), is
    read through the registry, so the README's table is the whole list."""
    offenders = [f"{path}:{line}" for module, path in package_modules().items() if module != "pagedllm.envs"
                 for line in environment_reads(path.read_text())]
    assert not offenders, offenders
    sample = ("import os\na = os.environ.get('X')\nb = os.environ['Y']\nc = 'Z' in os.environ\nd = os.getenv('W')\n"
              "os.environ['V'] = '1'\ne = dict(os.environ)\n")
    assert environment_reads(sample) == [2, 3, 4, 5]
