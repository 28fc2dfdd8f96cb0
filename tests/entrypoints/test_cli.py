"""The `pagedllm` command: generate and bench throughput, as a user runs them."""
from __future__ import annotations

import json
import subprocess
import sys
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.cli import build_parser
from pagedllm.entrypoints.cli_args import _flag_type, engine_args_from


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_the_same_text_as_the_api(tiny_llm_dir: Path) -> None:
    proc = _run("generate", "Hello there", "--model", str(tiny_llm_dir), "--dtype", "float32",
                "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--num-kv-blocks", "64",
                "--enable-prefix-caching", "false", "--swap-space", "8")
    assert proc.returncode == 0, proc.stderr
    expected = LLM(str(tiny_llm_dir), dtype="float32", num_kv_blocks=64).generate(
        "Hello there", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert "finish_reason=length" in proc.stdout
    assert expected.outputs[0].text in proc.stdout


def test_generate_refuses_bad_input_clearly(tiny_llm_dir: Path) -> None:
    proc = _run("generate", "x", "--model", str(tiny_llm_dir), "--temperature", "-1")
    assert proc.returncode == 2 and "temperature" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_throughput_prints_one_json_line(tiny_llm_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = _run("bench", "throughput", "--model", str(tiny_llm_dir), "--dtype", "float32", "--input-len", "16",
                "--output-len", "8", "--num-prompts", "6", "--output-json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    assert result["num_requests"] == 6 and result["total_num_tokens"] == 6 * (16 + 8)
    for key in ("elapsed_time", "requests_per_second", "tokens_per_second", "output_tokens_per_second"):
        assert result[key] > 0
    # how the model loaded: rank 0's start-up line, and the figures in the output and the JSON
    assert "Loaded weights in " in proc.stderr
    assert result["load_time_s"] > 0 and 0 < result["weights_gib"] < result["load_peak_rss_gib"]
    assert result["ranks"][0]["load_seconds"] == result["load_time_s"]
    assert f"peak RSS {result['load_peak_rss_gib']:.2f} GiB while loading" in proc.stdout


@pytest.mark.parametrize("command", [["serve"], ["generate", "a prompt"], ["bench", "throughput"]])
def test_every_engine_option_round_trips_through_the_cli(command: list[str]) -> None:
    """Each EngineArgs field is a flag of its own type: a non-default value comes back unchanged."""
    hints = typing.get_type_hints(EngineArgs)
    expected, argv = {}, list(command)
    for f in fields(EngineArgs):
        kind = _flag_type(hints[f.name])
        value = {bool: lambda f=f: not f.default, int: lambda f=f: (f.default or 0) + 3,
                 float: lambda f=f: (f.default or 0) + 1.5, str: lambda f=f: f"value-of-{f.name}"}[kind]()
        expected[f.name] = value
        flag = "--" + f.name.replace("_", "-")
        argv += ([flag] if value else ["--no-" + flag[2:]]) if kind is bool else [flag, str(value)]
    assert engine_args_from(build_parser().parse_args(argv)) == EngineArgs(**expected)


@pytest.mark.parametrize("argv, value", [(["--enable-prefix-caching", "false"], False),
                                         (["--enable-prefix-caching=no"], False),
                                         (["--no-enable-prefix-caching"], False),
                                         (["--enable-prefix-caching"], True), ([], True)])
def test_boolean_flags_take_vllm_forms_and_explicit_values(argv: list[str], value: bool) -> None:
    ns = build_parser().parse_args(["serve", *argv, "--swap-space", "8"])
    assert ns.enable_prefix_caching is value and ns.swap_space == 8.0 and ns.model_tag is None


def test_a_bad_boolean_is_refused_by_name(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--enable-prefix-caching", "maybe"])
    assert "--enable-prefix-caching" in capsys.readouterr().err


def test_models_lists_the_registry_and_its_flags_hold(capsys: pytest.CaptureFixture) -> None:
    """`pagedllm models` prints every registered architecture; each feature flag agrees with the code."""
    import importlib

    from pagedllm.models.loader.gguf_loader import _ARCHITECTURES
    from pagedllm.models.registry import supported_models

    args = build_parser().parse_args(["models"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    for name, entry in supported_models().items():
        row = next(line for line in printed.splitlines() if line.startswith(f"| {name} |"))
        assert entry.families in row
        # GGUF's "llama" with experts is Mixtral
        assert entry.gguf == (name in _ARCHITECTURES.values() or name == "MixtralForCausalLM"), name
        module, cls = entry.path.split(":")
        model_cls = getattr(importlib.import_module(module), cls)
        assert entry.lora == bool(getattr(model_cls, "supported_lora_modules", ())), name


def test_serve_defaults_to_one_second_and_generate_is_off() -> None:
    """step_time_target: on for the server (0.8 s), off offline, as vLLM's UsageContext does."""
    parser = build_parser()
    assert parser.parse_args(["serve"]).step_time_target == 0.8
    assert parser.parse_args(["serve", "--step-time-target", "0.25"]).step_time_target == 0.25
    assert parser.parse_args(["generate", "hi"]).step_time_target is None
