"""`pagedllm bench latency`: vLLM's single-batch latency benchmark, on a tiny random model."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedllm.entrypoints.bench.latency import spec_decode_summary
from pagedllm.entrypoints.cli import build_parser
from pagedllm.errors import ValidationError

SMALL = ["--num-iters", "2", "--num-iters-warmup", "1", "--output-len", "4", "--batch-size", "2",
         "--dtype", "float32", "--num-kv-blocks", "64"]
PROSE = Path(__file__).parents[1] / "data" / "prose.txt"


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "latency", *args],
                          capture_output=True, text=True, timeout=300)


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> dict[str, Any]:
    """Run the command in this process; the JSON line it printed last."""
    ns = build_parser().parse_args(["bench", "latency", *argv])
    assert ns.func(ns) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _check_latencies(result: dict[str, Any], num_iters: int, output_tokens: int, sequences: int) -> None:
    assert len(result["latencies"]) == num_iters and all(t > 0 for t in result["latencies"])
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / num_iters)
    assert result["std_latency"] >= 0
    percentiles = [result["percentiles"][p] for p in ("10", "25", "50", "75", "90", "99")]
    assert list(result["percentiles"]) == ["10", "25", "50", "75", "90", "99"]  # vLLM's keys, as JSON writes them
    assert percentiles == sorted(percentiles)
    assert min(result["latencies"]) <= percentiles[0] and percentiles[-1] <= max(result["latencies"])
    assert result["output_tokens_per_second"] == pytest.approx(output_tokens / result["avg_latency"])
    assert result["output_tokens_per_second_per_sequence"] == pytest.approx(
        output_tokens / sequences / result["avg_latency"])


def test_the_command_prints_vllm_lines_and_one_json_line(tiny_llm_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    proc = _run_cli("--model", str(tiny_llm_dir), "--input-len", "8", *SMALL, "--output-json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    _check_latencies(result, num_iters=2, output_tokens=4 * 2, sequences=2)
    assert result["input_len"] == 8 and result["output_len"] == 4 and result["batch_size"] == 2
    assert result["temperature"] == 1.0 and result["prompt_file"] is None and result["steps_per_iteration"] >= 4
    assert f"Avg latency: {result['avg_latency']} seconds" in proc.stdout
    assert f"99% percentile latency: {result['percentiles']['99']} seconds" in proc.stdout
    assert "Output tokens/s:" in proc.stdout and "per sequence" in proc.stdout
    assert "Bench iterations" in proc.stderr  # tqdm's progress
    # the load's figures: the start-up line (rank 0's log) and the benchmark's own, the same figures in its JSON
    assert "Loaded weights in " in proc.stderr and "GiB of weights, peak RSS " in proc.stderr
    assert result["load_time_s"] > 0 and 0 < result["weights_gib"] < result["load_peak_rss_gib"]
    assert f"Load: {result['load_time_s']:.1f} s for {result['weights_gib']:.2f} GiB of weights" in proc.stdout


def test_a_prompt_file_is_every_prompt_of_the_batch(tiny_llm_dir: Path, tokenizer: Any, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Summarise in one line:\n" + PROSE.read_text()[:400])  # the tiny model holds 512 positions
    result = _run(["--model", str(tiny_llm_dir), "--prompt-file", str(prompt), "--temperature", "0", *SMALL], capsys)
    assert result["input_len"] == len(tokenizer.encode(prompt.read_text())) > 8
    assert result["prompt_file"] == str(prompt) and result["temperature"] == 0.0
    _check_latencies(result, num_iters=2, output_tokens=4 * 2, sequences=2)


def test_parallel_samples_and_beam_search(tiny_llm_dir: Path, capsys: pytest.CaptureFixture) -> None:
    for extra in ([], ["--use-beam-search"]):
        result = _run(["--model", str(tiny_llm_dir), "--input-len", "8", *SMALL, "--n", "2", *extra], capsys)
        assert result["n"] == 2 and result["use_beam_search"] == bool(extra)
        _check_latencies(result, num_iters=2, output_tokens=4 * 2 * 2, sequences=4)


def test_speculative_acceptance_counts_only_the_timed_iterations() -> None:
    before = {"num_steps": 5, "spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 6,
              "spec_decode_num_accepted_tokens": 1}
    after = {"num_steps": 9, "spec_decode_num_drafts": 6, "spec_decode_num_draft_tokens": 18,
             "spec_decode_num_accepted_tokens": 7}
    assert spec_decode_summary(before, after) == {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6,
                                                  "acceptance_rate": 0.5, "mean_acceptance_length": 2.5}
    assert spec_decode_summary(before, before) is None and spec_decode_summary({}, {"num_steps": 3}) is None


def test_prefix_caching_is_off_unless_asked() -> None:
    """As vLLM's bench latency: otherwise every iteration after the first would reuse the prompts' K/V."""
    assert build_parser().parse_args(["bench", "latency"]).enable_prefix_caching is False
    assert build_parser().parse_args(["bench", "latency", "--enable-prefix-caching"]).enable_prefix_caching is True
    assert build_parser().parse_args(["bench", "throughput"]).enable_prefix_caching is True


@pytest.mark.parametrize("argv, flag", [
    (["--num-iters", "0"], "--num-iters"),
    (["--num-iters-warmup", "-1"], "--num-iters-warmup"),
    (["--batch-size", "0"], "--batch-size"),
    (["--output-len", "0"], "--output-len"),
    (["--input-len", "0"], "--input-len"),
    (["--n", "0"], "--n"),
    (["--temperature", "-1"], "--temperature"),
    (["--use-beam-search", "--temperature", "0.7"], "--temperature"),
    (["--disable-detokenize"], "--disable-detokenize"),
    (["--input-len", "8", "--prompt-file", str(PROSE)], "--input-len"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file"),
])
def test_bad_flags_are_refused_by_name_before_a_model_loads(argv: list[str], flag: str) -> None:
    ns = build_parser().parse_args(["bench", "latency", "--model", "/nonexistent/model", *argv])
    with pytest.raises(ValidationError, match=flag):
        ns.func(ns)


def test_the_command_exits_2_naming_the_flag() -> None:
    proc = _run_cli("--num-iters", "0")
    assert proc.returncode == 2 and "--num-iters must be an integer >= 1, got 0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_batch_longer_than_the_model_is_refused(tiny_llm_dir: Path) -> None:
    ns = build_parser().parse_args(["bench", "latency", "--model", str(tiny_llm_dir), "--input-len", "8",
                                    "--max-model-len", "10", *SMALL])
    with pytest.raises(ValidationError, match="max_model_len 10"):
        ns.func(ns)
