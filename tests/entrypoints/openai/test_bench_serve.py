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
