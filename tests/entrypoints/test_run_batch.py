"""`pagedllm run-batch` (vLLM's `vllm run-batch`) on a small OpenAI batch file with the tiny model: good lines
answered as the server answers them, bad lines with their own error lines, output in input order."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

LINES = [
    {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}},
    "this line is not JSON",
    {"custom_id": "comp-1", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}},
    {"custom_id": "bad-url", "method": "POST", "url": "/v1/nothing", "body": {}},
    {"custom_id": "streamed", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": "x", "stream": True}},
    {"custom_id": "refused", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": "x", "temperature": -1}},
    {"custom_id": "other-model", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "nope", "messages": [{"role": "user", "content": "Hi"}]}},
    {"custom_id": "background", "method": "POST", "url": "/v1/responses",
     "body": {"model": "tiny", "input": "Hi", "background": True}},
]


def test_run_batch(tiny_llm_dir: Path, tmp_path: Path) -> None:
    batch, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    batch.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in LINES) + "\n\n")
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "run-batch", "-i", str(batch),
                           "-o", str(out), str(tiny_llm_dir), "--served-model-name", "tiny", "--dtype", "float32",
                           "--num-kv-blocks", "64"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["chat-1", None, "comp-1", "bad-url", "streamed", "refused",
                                                 "other-model", "background"]
    for r in results:
        assert set(r) == {"id", "custom_id", "response", "error"}
        assert set(r["response"]) == {"status_code", "request_id", "body"}
    chat, not_json, completion, bad_url, streamed, refused, other, background = results
    assert chat["response"]["status_code"] == 200 and chat["error"] is None
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert completion["response"]["body"]["choices"][0]["text"]
    assert not_json["response"]["status_code"] == 400 and "line 2 is not valid JSON" in \
        not_json["error"]["error"]["message"]
    assert bad_url["error"]["error"]["param"] == "url"
    assert streamed["error"]["error"]["param"] == "body.stream"
    assert background["error"]["error"]["param"] == "body.background"
    # refused by the server's own checks, in its own words
    assert refused["response"]["status_code"] == 400 and refused["response"]["body"] is None
    assert refused["error"]["error"]["param"] == "temperature"
    assert other["response"]["status_code"] == 404
    assert "Running batch" in proc.stderr  # the progress bar


def test_run_batch_missing_input(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "run-batch", "-i",
                           str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "out.jsonl")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "input-file" in proc.stderr and "Traceback" not in proc.stderr
