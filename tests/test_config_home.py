"""Configuration has one home (issue 46, point 1): EngineArgs' fields are L0's config/options.py, and
``EngineArgs.create_engine_config()`` resolves every one of them in engine/arg_resolve.py, the only module that
builds the engine's configs. Adding an option is a field (its CLI flag is generated) and its resolution there."""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import pagedllm
from pagedllm.config.options import EngineOptions
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.errors import ValidationError

PACKAGE = Path(pagedllm.__file__).parent
RESOLVER = PACKAGE / "engine" / "arg_resolve.py"

ENGINE_CONFIGS = frozenset({"EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig", "ParallelConfig",
                            "DeviceConfig", "LoRAConfig", "SpeculativeConfig", "WatermarkConfig", "PoolerConfig",
                            "StructuredOutputsConfig"})
"""The configs an engine is built from."""

ALSO_BUILDS = {
    "entrypoints/bench/plan.py": {"CacheConfig", "SchedulerConfig"},  # the planner replays a scheduler it sizes
    "entrypoints/bench/memory_sim/paged.py": {"CacheConfig", "SchedulerConfig"},  # the memory simulator's own
    "worker/structured_output.py": {"StructuredOutputsConfig"},  # the compiler's default budget, for tests
    "config/__init__.py": {"StructuredOutputsConfig"},  # EngineConfig's field default
}
"""Modules outside the resolver that build one of those configs, and which: none of them from a user's options."""


def options_read(source: str, names: tuple[str, ...] = ("args", "options")) -> set[str]:
    """The attributes read off a variable named one of ``names`` in ``source``."""
    return {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id in names}


def configs_built(source: str) -> set[str]:
    """The engine configs ``source`` calls the constructor of."""
    built = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in ENGINE_CONFIGS:
                built.add(name)
    return built


def test_every_option_is_read_by_the_resolver() -> None:
    """An option nobody reads would be silently ignored: each field is read in engine/arg_resolve.py."""
    names = {f.name for f in dataclasses.fields(EngineOptions)}
    read = options_read(RESOLVER.read_text())
    assert names - read == set(), f"options never resolved: {sorted(names - read)}"
    assert read - names == set(), f"the resolver reads what is no option: {sorted(read - names)}"
    # the check sees a field it does not read, and a read through another name does not count
    assert options_read("def f(args):\n    return args.dtype, other.max_loras\n") == {"dtype"}


def test_only_the_resolver_builds_the_engine_configs() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "engine/arg_resolve.py" or rel.startswith("config/") and rel != "config/__init__.py":
            continue  # the resolver, and the configs' own alternate constructors (from_user)
        built = configs_built(path.read_text()) - ALSO_BUILDS.get(rel, set())
        if built:
            found[rel] = sorted(built)
    assert found == {}, f"configs built outside engine/arg_resolve.py: {found}"
    assert configs_built("CacheConfig(block_size=16)\nx = config.ModelConfig()\n") == {"CacheConfig", "ModelConfig"}
    # the resolver does build each of them
    assert configs_built(RESOLVER.read_text()) >= ENGINE_CONFIGS - {"SpeculativeConfig", "WatermarkConfig"}


def test_engine_args_is_vllms_and_resolves_through_one_method() -> None:
    assert pagedllm.EngineArgs is EngineArgs and issubclass(EngineArgs, EngineOptions)
    assert [f.name for f in dataclasses.fields(EngineArgs)] == [f.name for f in dataclasses.fields(EngineOptions)]
    definitions = [path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                   if "def create_engine_config" in path.read_text()]
    assert definitions == ["engine/arg_utils.py"]
    with pytest.raises(ValidationError) as refused:
        EngineArgs.from_kwargs(max_num_seq=4)
    assert refused.value.param == "max_num_seq"


def test_resolution_refuses_naming_the_option(tiny_llm_dir: Path) -> None:
    for options, param in (({"max_model_len": 0}, "max_model_len"), ({"max_logprobs": -2}, "max_logprobs"),
                           ({"enable_sleep_mode": "yes"}, "enable_sleep_mode"),
                           ({"runner": "pooling", "enable_lora": True}, "enable_lora"),
                           ({"kv_cache_memory": "lots"}, "kv_cache_memory"),
                           ({"grammar_cache_memory": "-1"}, "grammar_cache_memory")):
        with pytest.raises(ValidationError) as refused:
            EngineArgs(model=str(tiny_llm_dir), **options).create_engine_config()
        assert refused.value.param == param, (options, refused.value)
    config, arch = EngineArgs(model=str(tiny_llm_dir), dtype="float32", max_model_len=64).create_engine_config()
    assert (config.model.max_model_len, config.model.dtype, config.scheduler.max_model_len) == (64, "float32", 64)
    assert config.model.max_logprobs == 20
    config, arch = EngineArgs(model=str(tiny_llm_dir), max_logprobs=-1).create_engine_config()
    assert config.model.max_logprobs == arch.vocab_size  # -1: the vocabulary


def test_the_cli_reads_the_options_without_loading_torch() -> None:
    """The resolver (torch, the model loaders) loads only when an engine is built: `pagedllm serve` starts its
    engine core before its own heavy imports, and builds its flags from EngineArgs' fields first."""
    code = ("import sys\nfrom pagedllm.entrypoints import cli_args\nfrom pagedllm import EngineArgs\n"
            "import argparse\ncli_args.add_engine_args(argparse.ArgumentParser())\nEngineArgs(model='x')\n"
            "assert 'torch' not in sys.modules and 'pagedllm.engine.arg_resolve' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent, timeout=120)
