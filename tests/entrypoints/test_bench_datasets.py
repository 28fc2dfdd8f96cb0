"""Datasets of `pagedllm bench throughput` (random, synthetic traces, ShareGPT files) and compare.py's commands."""
from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from pagedllm.entrypoints import cli
from pagedllm.entrypoints.bench import throughput
from pagedllm.entrypoints.bench.datasets import (
    WORD_TOKEN_LOW,
    length_bounds,
    load_sharegpt,
    random_prompts,
    random_requests,
    synthetic_lengths,
    synthetic_requests,
    word_token_ids,
    write_sharegpt_file,
)
from pagedllm.entrypoints.bench.traces import TRACE_SPECS
from pagedllm.errors import ValidationError

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- random
def test_random_lengths_stay_in_the_range_and_are_seeded() -> None:
    reqs = random_requests(300, 100, 50, vocab_size=1000, seed=3, range_ratio=0.2)
    assert length_bounds(100, 0.2) == (80, 120) and length_bounds(50, 0.2) == (40, 60)
    ins, outs = [r.prompt_len for r in reqs], [r.output_len for r in reqs]
    assert min(ins) >= 80 and max(ins) <= 120 and min(outs) >= 40 and max(outs) <= 60
    assert len(set(ins)) > 20 and len(set(outs)) > 10  # spread over the range, not one value
    assert all(len(r.prompt) == r.prompt_len and all(0 <= t < 1000 for t in r.prompt) for r in reqs)
    assert random_requests(300, 100, 50, 1000, 3, 0.2) == reqs
    assert random_requests(300, 100, 50, 1000, 4, 0.2) != reqs


def test_random_without_range_keeps_the_old_prompts() -> None:
    """Range ratio 0: fixed lengths and the prompts hf_static_batching.py builds (random_prompts)."""
    reqs = random_requests(5, 16, 8, vocab_size=500, seed=7)
    assert {(r.prompt_len, r.output_len) for r in reqs} == {(16, 8)}
    rng = np.random.default_rng(7)
    assert [r.prompt for r in reqs] == [rng.integers(0, 500, 16).tolist() for _ in range(5)]
    assert random_prompts(5, 16, 500, 7) == [{"prompt_token_ids": r.prompt} for r in reqs]
    with pytest.raises(ValidationError, match="random_range_ratio"):
        random_requests(5, 16, 8, 500, 7, range_ratio=1.0)


# -------------------------------------------------------------------------- synthetic
@pytest.mark.parametrize("name,trace", [("sharegpt-like", "sharegpt"), ("alpaca-like", "alpaca")])
def test_synthetic_traces_have_the_paper_means(name: str, trace: str) -> None:
    lengths = synthetic_lengths(name, 2000, seed=0)
    spec = TRACE_SPECS[trace]
    mean_in = sum(p for p, _ in lengths) / len(lengths)
    mean_out = sum(o for _, o in lengths) / len(lengths)
    assert abs(mean_in / spec.mean_input - 1) < 0.15 and abs(mean_out / spec.mean_output - 1) < 0.15
    assert all(p >= 4 and o >= 4 and p + o <= 2048 for p, o in lengths)
    assert synthetic_lengths(name, 2000, seed=0) == lengths and synthetic_lengths(name, 2000, seed=1) != lengths
    reqs = synthetic_requests(name, 200, vocab_size=300, seed=0, max_total_len=256)
    assert all(len(r.prompt) == r.prompt_len and r.prompt_len + r.output_len <= 256 for r in reqs)


# --------------------------------------------------------------------------- sharegpt
@pytest.fixture(scope="module")
def words(tokenizer: Any) -> np.ndarray:
    return word_token_ids(tokenizer)


def _text(tokenizer: Any, words: np.ndarray, n: int, seed: int) -> str:
    """A text of exactly n tokens (word tokens tokenize back one to one)."""
    text = tokenizer.decode(np.random.default_rng(seed).choice(words, n).tolist())
    assert len(tokenizer.encode(text)) == n
    return text


def _conv(*turns: str) -> dict:
    return {"conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]}


def test_sharegpt_loader_applies_vllms_filters_and_order(tokenizer: Any, words: np.ndarray, tmp_path: Path) -> None:
    pairs = {  # (prompt tokens, output tokens) -> kept?
        (10, 20): True, (3, 20): False, (10, 3): False, (4, 4): True,
        (1024, 10): True, (1025, 10): False, (1000, 1048): True, (1000, 1049): False,
    }
    def text(n: int, seed: int) -> str:
        return _text(tokenizer, words, n, seed)

    entries = [_conv(text(p, i), text(o, 100 + i)) for i, (p, o) in enumerate(pairs)]
    entries.append(_conv(text(12, 50), text(9, 51), text(30, 52)))  # 3 turns: the first two count
    valid_prompts = {e["conversations"][0]["value"] for e, ok in zip(entries, [*pairs.values(), True]) if ok}
    entries += [_conv(text(12, 60)), {"id": "no conversations"}, {"conversations": []}]  # dropped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    kept = {pair for pair, ok in pairs.items() if ok} | {(12, 9)}

    reqs = load_sharegpt(str(path), len(kept), tokenizer, seed=0)
    assert {(r.prompt_len, r.output_len) for r in reqs} == kept and len(reqs) == len(kept)
    # the order is vLLM's: random.seed(seed); random.shuffle(entries with >= 2 turns), then filtered
    two_turns = [e for e in entries if len(e.get("conversations") or ()) >= 2]
    random.seed(0)
    random.shuffle(two_turns)
    assert [r.prompt for r in reqs] == [e["conversations"][0]["value"] for e in two_turns
                                        if e["conversations"][0]["value"] in valid_prompts]
    assert load_sharegpt(str(path), 2, tokenizer, seed=0) == reqs[:2]
    more = load_sharegpt(str(path), len(kept) + 4, tokenizer, seed=0)  # oversampled, as vLLM does
    assert more[:len(kept)] == reqs and all(r in reqs for r in more[len(kept):])

    with pytest.raises(ValidationError, match="no such file"):
        load_sharegpt(str(tmp_path / "missing.json"), 1, tokenizer)
    (tmp_path / "bad.json").write_text(json.dumps([_conv("a", "b")]))
    with pytest.raises(ValidationError, match="length filters"):
        load_sharegpt(str(tmp_path / "bad.json"), 1, tokenizer)


def test_make_dataset_round_trip(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "alpaca.json"
    summary = write_sharegpt_file(str(path), "alpaca-like", 60, seed=1, tokenizer=tokenizer)
    data = json.loads(path.read_text())
    assert len(data) == 60 and summary["num_valid"] == 60
    assert all([t["from"] for t in e["conversations"]] == ["human", "gpt"] for e in data)
    assert min(word_token_ids(tokenizer)) >= WORD_TOKEN_LOW
    drawn = synthetic_lengths("alpaca-like", 60, seed=1)
    reqs = load_sharegpt(str(path), 60, tokenizer, seed=1)
    # SmolLM2's word tokens tokenize back one to one: the file holds exactly the drawn lengths
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == sorted(drawn)
    assert summary["mean_input_len"] == summary["mean_drawn_input_len"]


# ------------------------------------------------------------------------------- CLI
def test_cli_aliases_and_dataset_checks(capsys: pytest.CaptureFixture) -> None:
    ns = cli.build_parser().parse_args(["bench", "throughput", "--input-len", "16", "--output-len", "8"])
    assert (ns.random_input_len, ns.random_output_len, ns.dataset_name) == (16, 8, "random")
    assert throughput.dataset_seed(ns) == 0
    ns = cli.build_parser().parse_args(["bench", "throughput", "--seed", "3"])
    assert throughput.dataset_seed(ns) == 3
    ns = cli.build_parser().parse_args(["bench", "throughput", "--seed", "3", "--dataset-seed", "5"])
    assert throughput.dataset_seed(ns) == 5 and ns.seed == 3
    # refused before any model is loaded
    assert cli.main(["bench", "throughput", "--dataset-name", "sharegpt"]) == 2
    assert "--dataset-path" in capsys.readouterr().err
    assert cli.main(["bench", "throughput", "--random-range-ratio", "1.5"]) == 2
    assert "random_range_ratio" in capsys.readouterr().err


def test_bench_throughput_on_a_sharegpt_file(tiny_llm_dir: Path, tokenizer: Any, tmp_path: Path) -> None:
    data = tmp_path / "alpaca.json"
    run = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench"]
    proc = subprocess.run([*run, "make-dataset", "--dataset-name", "alpaca-like", "--num-prompts", "4", "--seed",
                           "0", "--output", str(data), "--model", str(tiny_llm_dir)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["num_conversations"] == 4
    proc = subprocess.run([*run, "throughput", "--model", str(tiny_llm_dir), "--dtype", "float32",
                           "--dataset-name", "sharegpt", "--dataset-path", str(data), "--num-prompts", "4"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    reqs = load_sharegpt(str(data), 4, tokenizer, seed=0)
    assert result["dataset_name"] == "sharegpt" and result["num_requests"] == 4
    assert result["total_output_tokens"] == sum(r.output_len for r in reqs)  # EOS ignored: every token made
    assert result["total_num_tokens"] == sum(r.prompt_len + r.output_len for r in reqs)
    for key in ("elapsed_time", "requests_per_second", "tokens_per_second", "output_tokens_per_second"):
        assert result[key] > 0


# ------------------------------------------------------------------ benchmarks/compare.py
@pytest.fixture(scope="module")
def compare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compare", ROOT / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_runs_every_engine_on_one_sharegpt_file(compare: ModuleType, capsys: pytest.CaptureFixture) -> None:
    compare.main(["--engines", "pagedllm", "pagedllm-gguf", "vllm", "--dataset-name", "sharegpt-like",
                  "--num-prompts", "32", "--dry-run"])
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.strip().splitlines())
    assert lines["dataset"].endswith("pagedllm bench make-dataset --dataset-name sharegpt-like --num-prompts 32 "
                                     "--seed 0 --output '<tmp>/sharegpt-like.json'")
    shared = "--dataset-name sharegpt --dataset-path '<tmp>/sharegpt-like.json' --num-prompts 32 --seed 0"
    assert lines["pagedllm"].endswith(f"bench throughput --dtype bfloat16 --dequantize {shared}")
    assert lines["pagedllm-gguf"].endswith(f"bench throughput --dtype bfloat16 {shared}")  # the GGUF kept
    assert lines["vllm"].endswith(f"peers/vllm-cpu throughput {shared} --dtype bfloat16 "
                                  "--output-json '<tmp>/result.json'")
    with pytest.raises(SystemExit) as exc:
        compare.main(["--engines", "pagedllm", "transformers", "--dataset-name", "alpaca-like"])
    assert exc.value.code == 2 and "transformers" in capsys.readouterr().err
    assert compare.OUTPUT_TOKENS.search("Throughput: ...\nTotal num output tokens:  1234\n").group(1) == "1234"


def test_compare_cold_start_commands(compare: ModuleType) -> None:
    ns = compare.argparse.Namespace(dtype="bfloat16")
    ours = compare.cold_start_command("pagedllm", ns, 123.5)
    assert ours[:2] == [sys.executable, "-c"] and ours[3:] == ["123.5", "bfloat16"]
    peer = compare.cold_start_command("vllm", ns, 123.5, "/models/smollm2")
    assert peer[0].endswith("peers/vllm-cpu") and peer[1:3] == ["python", "-c"]
    assert peer[4:] == ["123.5", "/models/smollm2", "bfloat16"] and "from vllm import LLM" in peer[3]
    for code in (ours[2], peer[3]):
        compile(code, "<cold-start>", "exec")
        assert "max_tokens=1" in code and "time.time() - start" in code


def _serve_sweep(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """benchmarks/serve_sweep.py as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports compare.py and big_models.py beside it
    spec = importlib.util.spec_from_file_location("serve_sweep", ROOT / "benchmarks" / "serve_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


def test_serve_sweep_drives_both_servers_with_one_client(capsys: pytest.CaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/serve_sweep.py: both servers on 127.0.0.1, the same `bench serve` command per rate."""
    sweep = _serve_sweep(monkeypatch)
    sweep.main(["--rates", "0.5", "2", "--num-prompts", "10", "--dry-run"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert "serve --host 127.0.0.1 --port 8230 --dtype bfloat16" in lines[0]
    assert lines[1].startswith("vllm server:") and "peers/vllm-cpu serve --host 127.0.0.1 --port 8231" in lines[1]
    clients = [line for line in lines if line.startswith("client:")]
    assert len(clients) == 2 and all("bench serve" in c and "--dataset-name sharegpt-like --num-prompts 10" in c
                                     for c in clients)
    assert "--request-rate 0.5" in clients[0] and "--request-rate 2.0" in clients[1]
    import os

    assert sweep.tree_cpu_seconds(os.getpid()) > 0  # this process has used CPU: /proc is read right


def test_serve_sweep_at_a_shape_gives_both_servers_the_same_kv_bytes(capsys: pytest.CaptureFixture,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """--shape: both servers on the shape's folder with random weights, the same max_model_len and KV bytes (vLLM's
    without the peer script's whole-GiB VLLM_CPU_KVCACHE_SPACE, which would override them); --duration: rate x S
    requests at each rate."""
    sweep = _serve_sweep(monkeypatch)
    sweep.main(["--shape", "tiny", "--kv-cache-memory", "0.5", "--max-model-len", "256", "--rates", "0.5", "2",
                "--duration", "10", "--kv-cache-dtype", "int8", "--vllm-kv-cache-dtype", "fp8", "--dry-run"])
    ours, vllm, *clients = capsys.readouterr().out.strip().splitlines()
    hf = sweep.paths("tiny")["hf"]
    for line in (ours, vllm):
        assert f"--model {hf} --load-format dummy --max-model-len 256" in line
    assert "--kv-cache-memory 536870912" in ours and "--kv-cache-dtype int8" in ours
    assert "--kv-cache-dtype fp8" in vllm
    assert "--kv-cache-memory-bytes 536870912" in vllm and 'os.environ.pop("VLLM_CPU_KVCACHE_SPACE"' in vllm
    assert [f"--tokenizer {hf}" in c for c in clients] == [True, True]
    assert "--num-prompts 5 --request-rate 0.5" in clients[0] and "--num-prompts 20 --request-rate 2.0" in clients[1]


def test_serve_sweep_counts_preemptions_and_finds_the_knee(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    """Preemptions: the num_preemptions_total samples of /metrics summed (pagedllm:*, else vllm:*: our server shows
    both); the KV pool from either start-up log;
    the sustained rate: the last before the first over the factor or failing, and ours / vLLM's."""
    sweep = _serve_sweep(monkeypatch)
    metrics = ('# HELP pagedllm:num_preemptions_total Preemptions.\n'
               'pagedllm:num_preemptions_total{engine="0",model_name="m"} 3.0\n'
               'pagedllm:num_preemptions_created{engine="0",model_name="m"} 1.7e+09\n'
               'vllm:num_preemptions_total{engine="1",model_name="m"} 4.0\n')
    monkeypatch.setattr(sweep.httpx, "get", lambda url, timeout: type("R", (), {"text": metrics})())
    assert sweep.preemptions(8230) == 3.0  # ours: the vllm:* copies are not counted twice
    vllm_only = 'vllm:num_preemptions_total{engine="0",model_name="m"} 4.0\nvllm:num_preemptions_total{engine="1"} 2\n'
    monkeypatch.setattr(sweep.httpx, "get", lambda url, timeout: type("R", (), {"text": vllm_only})())
    assert sweep.preemptions(8230) == 6.0
    for text, tokens in (("KV cache 32 blocks of 16 tokens, 2 KV heads", 512),
                         ("CPU KV cache size: 6,826 tokens", 6826), ("nothing", None)):
        (tmp_path / "log").write_text(text)
        assert sweep.kv_tokens(str(tmp_path / "log")) == tokens

    def rows(engine: str, points: list[tuple[float, float, int]]) -> list[dict]:
        return [{"engine": engine, "request_rate": r, "normalized_latency_s_per_token": lat, "failed": failed,
                 "completed": 4 - failed, "num_requests": 4, "tokens_per_second": 9.0, "preemptions": 1.0}
                for r, lat, failed in points]

    ours = rows("pagedllm", [(0.3, 0.19, 0), (0.1, 0.1, 0), (0.2, 0.15, 0), (0.4, 0.21, 0), (0.5, 0.12, 0)])
    vllm = rows("vllm", [(0.1, 0.2, 0), (0.2, 0.3, 1), (0.3, 0.3, 0)])
    assert sweep.sustained_rate(ours, "pagedllm", 2.0) == (0.3, True)
    assert sweep.sustained_rate(ours, "pagedllm", 3.0) == (0.5, False)
    assert sweep.sustained_rate(vllm, "vllm", 2.0) == (0.1, True)
    args = sweep.argparse.Namespace(engines=["pagedllm", "vllm"], knee_factor=2.0)
    knees = sweep.knee_report(ours + vllm, args)
    assert knees["pagedllm"]["vs_vllm"] == pytest.approx(3.0) and knees["pagedllm"]["vs_vllm_bound"] == ""
    assert "pagedllm / vLLM: 3.00x" in capsys.readouterr().out
    # one bound for both, vLLM's knee (2 x its 0.2 at the lowest rate): ours stays under 0.4 at every rate
    assert knees["pagedllm"]["at_vllm_knee"] == {"rate": 0.5, "knee_seen": False, "vs_vllm": pytest.approx(5.0),
                                                 "vs_vllm_bound": ">="}
    assert knees["vllm"]["at_vllm_knee"] == {"rate": 0.1, "knee_seen": True}
    args.knee_factor = 3.0
    assert sweep.knee_report(ours + vllm, args)["pagedllm"]["vs_vllm_bound"] == ">="
    saved = tmp_path / "sweep.json"  # --report: a saved run's table and knees at another factor, nothing run
    saved.write_text(json.dumps({"settings": {"engines": ["pagedllm", "vllm"]}, "rows": ours + vllm[:1]}))
    capsys.readouterr()
    sweep.main(["--report", str(saved), "--knee-factor", "3"])
    out = capsys.readouterr().out
    assert "| 0.5 | pagedllm | 4/4 | 0.1200 | 9.0 | 1 |" in out and "unknown (neither saw its knee)" in out


def test_bench_serve_splits_sse_lines_at_newlines_only() -> None:
    """A data line whose JSON holds a raw U+2028 (allowed in JSON, sent by vLLM) stays one line."""
    import asyncio
    import json

    import httpx

    from pagedllm.entrypoints.bench.serve import _sse_lines

    events = [{"choices": [{"text": "a\u2028b\x85c"}]}, {"choices": [{"text": "d"}]}]
    body = "".join(f"data: {json.dumps(e, ensure_ascii=False)}\r\n\r\n" for e in events) + "data: [DONE]\n\n"
    raw = body.encode()

    class Pieces(httpx.AsyncByteStream):  # 5-byte pieces: lines and characters cut across reads
        async def __aiter__(self):  # type: ignore[override]
            for i in range(0, len(raw), 5):
                yield raw[i:i + 5]

    async def lines() -> list[str]:
        return [line async for line in _sse_lines(httpx.Response(200, stream=Pieces()))]

    got = [line for line in asyncio.run(lines()) if line]
    assert [json.loads(line[6:]) for line in got[:2]] == events and got[2] == "data: [DONE]"
