"""A long prompt shares the step (issue 43, point 5): against a real `pagedllm serve` at its default budgets, an
8,000-token prompt's late chunks shrink so no step attends more than max_num_batched_tokens squared query x key
positions, and a decoding stream gets a token at every one of its steps; with a step-time target, the prompt's
chunks beside the stream shrink further, to fit the target by the server's learned estimate. (The gap in seconds
on the default model is a benchmark figure: benchmarks/stream_gap.py, docs/BENCHMARKS.md.)"""
from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagedllm.core.scheduler import attended_positions
from tests.utils import RemoteServer, save_tiny_model

PROMPT_LEN = 8000
TOKENS, BLOCK = 2048, 16  # the server's defaults: max_num_batched_tokens, block_size
ATTENTION = TOKENS * TOKENS  # the servers' --max-num-batched-attention (the token budget squared)


TARGET = 0.01  # seconds: the tiny model's step beside a stream takes a few ms, so chunks must shrink to fit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Any:
    """The tiny model with room for an 8k prompt."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-8k"), "llama-gqa-untied", vocab_size=len(tokenizer),
                           tokenizer=tokenizer, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def server(model_dir: Any) -> Iterator[RemoteServer]:
    """Served with default budgets (a step-time target of 0.8 s: the tiny model's steps are far shorter)."""
    srv = RemoteServer(model_dir, "--served-model-name", "tiny", "--max-num-batched-attention", str(ATTENTION))
    yield srv
    srv.stop()


def long_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(PROMPT_LEN)]


def stats(server: RemoteServer) -> dict:
    return httpx.get(f"{server.url}/stats", timeout=10).json()


def expected_chunks(budget: int) -> list[int]:
    """A lone prompt's chunks: as many tokens as the token budget and the attention budget allow."""
    chunks, done = [], 0
    while done < PROMPT_LEN:
        c = min(TOKENS, PROMPT_LEN - done)
        while c > BLOCK and attended_positions(done, c) > budget:
            c -= 1
        chunks.append(c)
        done += c
    return chunks


def test_a_long_prompt_alone_runs_in_chunks_that_attend_at_most_the_budget(server: RemoteServer) -> None:
    before = stats(server)
    reply = httpx.post(f"{server.url}/v1/completions", timeout=300,
                       json={"model": "tiny", "prompt": long_prompt(0), "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    after = stats(server)
    chunks = expected_chunks(ATTENTION)
    # the first chunk is whole; later ones shrink: 2,048, 1,499, 1,032, ... 547, 71 (it was 2,048 x 3 and 1,856)
    assert chunks[:3] == [TOKENS, 1499, 1032] and len(chunks) == 9
    assert after["num_chunked_prefills"] - before["num_chunked_prefills"] == len(chunks) - 1
    # the last chunk used to attend 1,856 x ~7,100 = 13.2M positions; now each late one fills the budget (less
    # than one more token's positions short of it) and none goes past it
    assert ATTENTION - PROMPT_LEN <= after["max_step_attended_positions"] <= ATTENTION


def start_stream(server: RemoteServer) -> tuple[list[int], threading.Event, threading.Thread]:
    """A streamed completion decoding (ignore_eos, 8,000 tokens): its completion_tokens as each chunk reports
    them, the event that stops reading it (closing the stream aborts it), and its reading thread."""
    completion_tokens: list[int] = []
    seen, stop = threading.Event(), threading.Event()
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8000, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}

    def read_stream() -> None:  # until told to stop: closing the stream aborts the request
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if stop.is_set():
                    return
                if line.startswith("data: {"):
                    completion_tokens.append((json.loads(line[6:]).get("usage") or {}).get("completion_tokens", 0))
                    if len(completion_tokens) >= 5:
                        seen.set()

    reader = threading.Thread(target=read_stream, daemon=True)
    reader.start()
    assert seen.wait(60), "the stream never started"
    return completion_tokens, stop, reader


def test_a_stream_gets_a_token_at_every_step_of_a_long_prompt(server: RemoteServer) -> None:
    completion_tokens, stop, reader = start_stream(server)
    before = stats(server)
    reply = httpx.post(f"{server.url}/v1/completions", timeout=300,
                       json={"model": "tiny", "prompt": long_prompt(1), "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    after = stats(server)  # counted by the server: no lag of this process's reading thread
    stop.set()
    steps = after["num_chunked_prefills"] - before["num_chunked_prefills"] + 1
    assert steps >= 9  # its chunks shrink (beside the stream's token they attend a little less)
    # every step of the long prompt decoded a token of the stream too (the long prompt's own token is the 1)
    assert after["num_generated_tokens"] - before["num_generated_tokens"] - 1 >= steps
    assert completion_tokens[-1] < PROMPT_LEN  # the stream still ran when the long prompt finished
    reader.join(timeout=60)
    server.wait_idle(30)


def test_beside_a_stream_chunks_shrink_to_the_step_time_target(model_dir: Any) -> None:
    """--step-time-target: alone, the long prompt runs in the same 9 chunks (no decode waits: no cap); beside a
    decoding stream its chunks shrink to fit the target by the estimate the server learned from its own steps
    (or, for a step's first chunk, a block), and the stream still gets a token at every step."""
    srv = RemoteServer(model_dir, "--served-model-name", "tiny", "--step-time-target", str(TARGET),
                       "--max-num-batched-attention", str(ATTENTION))
    try:
        before = stats(srv)
        reply = httpx.post(f"{srv.url}/v1/completions", timeout=300,
                           json={"model": "tiny", "prompt": long_prompt(3), "max_tokens": 1})
        assert reply.status_code == 200, reply.text
        alone = stats(srv)
        assert alone["num_chunked_prefills"] - before["num_chunked_prefills"] + 1 == len(expected_chunks(ATTENTION))
        assert alone["num_step_time_shrunk_chunks"] == 0 and alone["step_time_token_s"] > 0  # learned, not used
        completion_tokens, stop, reader = start_stream(srv)
        before = stats(srv)
        reply = httpx.post(f"{srv.url}/v1/completions", timeout=300,
                           json={"model": "tiny", "prompt": long_prompt(4), "max_tokens": 1})
        assert reply.status_code == 200, reply.text
        after = stats(srv)
        stop.set()
        steps = after["num_chunked_prefills"] - before["num_chunked_prefills"] + 1
        shrunk = after["num_step_time_shrunk_chunks"] - before["num_step_time_shrunk_chunks"]
        print(f"chunks beside the stream: {steps} ({shrunk} shrunk by the target), decode estimate "
              f"{after['step_time_decode_s'] * 1e3:.2f} ms, prompt token {after['step_time_token_s'] * 1e6:.1f} us, "
              f"attended pair {after['step_time_pair_s'] * 1e9:.2f} ns, "
              f"most estimated step {after['max_step_estimated_s'] * 1e3:.2f} ms")
        assert steps > 2 * len(expected_chunks(ATTENTION)) and shrunk >= steps // 2  # more, smaller chunks
        assert after["step_time_decode_s"] > 0
        # every step the target shaped (its first chunk not held at a block) was estimated within the rule's time
        assert 0 < after["max_step_estimated_fraction"] <= 1 + 1e-9
        assert after["num_generated_tokens"] - before["num_generated_tokens"] - 1 >= steps  # a token every step
        assert completion_tokens[-1] < PROMPT_LEN
        reader.join(timeout=60)
        srv.wait_idle(30)
    finally:
        srv.stop()


def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_prompt_logprobs_of_a_long_prompt_keep_the_core_small(server: RemoteServer) -> None:
    """Top-20 prompt logprobs of 8,000 tokens: the core's peak RSS grows by far less than one chunk's full-vocabulary
    logits (2,048 x 49,152 float32 = 0.4 GB, and as much again for their log-softmax), scored 256 rows at a time."""
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        core = max((int(c) for c in f.read().split()), key=lambda pid: status_kib(pid, "VmRSS"))  # the core
    try:  # "5" resets the peak RSS (VmHWM) to the RSS now: the peak this request causes is then read exactly
        with open(f"/proc/{core}/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        pytest.skip(f"cannot reset the core's peak RSS: {e}")
    rss = status_kib(core, "VmRSS")
    reply = httpx.post(f"{server.url}/v1/completions", timeout=300,
                       json={"model": "tiny", "prompt": long_prompt(2), "max_tokens": 1, "prompt_logprobs": 20})
    assert reply.status_code == 200, reply.text
    scored = reply.json()["choices"][0]["prompt_logprobs"]
    assert len(scored) == PROMPT_LEN and scored[0] is None and all(len(e) >= 20 for e in scored[1:])
    growth_mib = (status_kib(core, "VmHWM") - rss) / 1024
    assert growth_mib < 400, growth_mib
