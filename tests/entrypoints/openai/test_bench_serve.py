"""`pagedllm bench serve` against a real server: every request completes, and the report adds up."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_serve_reports(server, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve", "--base-url", server.url,
                           "--num-prompts", "12", "--request-rate", "50", "--input-len", "16", "--output-len", "8",
                           "--output-json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result
    assert result["completed"] == 12 and result["failed"] == 0
    assert abs(result["output_tokens_per_second"] * result["elapsed_time"] - 12 * 8) < 1e-6
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert 0 < result[key]["p50"] <= result[key]["p99"]
    assert result["normalized_latency_s_per_token"] > 0
    for word in ("TTFT", "TPOT", "ITL", "normalized latency"):
        assert word in proc.stdout


def _bench(server, *args: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve", "--base-url", server.url,
                           "--request-rate", "50", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout


def test_bench_serve_sharegpt_file_asks_each_turns_length(server, tmp_path: Path, tokenizer) -> None:
    """Text prompts from a ShareGPT file; each request generates exactly its gpt turn's token count."""
    turns = [("Tell me about the sea.", "The sea is large and deep and full of fish."),
             ("What is two plus two?", "Two plus two is four, as everyone knows."),
             ("Hi", "Hello there"),  # "Hi" has fewer than 4 tokens: skipped, as vLLM skips it
             ("Name a colour that is warm.", "Red is a warm colour, and so is orange or yellow.")]
    path = tmp_path / "tiny_sharegpt.json"
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": h}, {"from": "gpt", "value": g}]}
                                for h, g in turns]))
    valid = [(h, g) for h, g in turns if len(tokenizer.encode(h)) >= 4 and len(tokenizer.encode(g)) >= 4]
    assert len(valid) == 3
    result, out = _bench(server, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "3")
    assert result["completed"] == 3 and result["failed"] == 0 and result["dataset_name"] == "sharegpt"
    expected_out = sum(len(tokenizer.encode(g)) for _, g in valid)
    assert round(result["output_tokens_per_second"] * result["elapsed_time"]) == expected_out
    assert result["mean_output_len"] * 3 == expected_out
    assert "sharegpt (mean" in out


def test_bench_serve_random_lengths_vary_per_request(server) -> None:
    result, _ = _bench(server, "--dataset-name", "random", "--random-input-len", "20", "--random-output-len", "10",
                       "--random-range-ratio", "0.5", "--num-prompts", "8")
    assert result["completed"] == 8
    total_out = round(result["output_tokens_per_second"] * result["elapsed_time"])
    assert total_out == round(result["mean_output_len"] * 8) and total_out != 80
    assert result["request_rate"] == 50


def test_bench_serve_rejects_bad_rate(server) -> None:
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serve", "--base-url", server.url,
                           "--request-rate", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "request_rate" in proc.stderr


def test_bench_serve_clips_the_trace_to_the_servers_max_model_len(server) -> None:
    """The tiny server's max_model_len is 512: the sharegpt-like trace (whose third request has 152 + 423 tokens
    at 2048) is clipped to it, as bench throughput clips it to its engine's, so every request is served."""
    from pagedllm.entrypoints.bench.datasets import synthetic_lengths

    assert max(p + o for p, o in synthetic_lengths("sharegpt-like", 3, 0, 2048)) > 512
    clipped = synthetic_lengths("sharegpt-like", 3, 0, 512)
    result, _ = _bench(server, "--dataset-name", "sharegpt-like", "--num-prompts", "3")
    assert result["completed"] == 3 and result["failed"] == 0
    assert result["mean_output_len"] == sum(o for _, o in clipped) / 3
