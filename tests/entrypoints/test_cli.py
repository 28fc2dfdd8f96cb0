"""The `pagedllm` command: generate and bench throughput, as a user runs them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pagedllm import LLM, SamplingParams


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_the_same_text_as_the_api(tiny_llm_dir: Path) -> None:
    proc = _run("generate", "Hello there", "--model", str(tiny_llm_dir), "--dtype", "float32",
                "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--num-kv-blocks", "64")
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
