"""vLLM's serve flags --uds, --enable-prompt-embeds and --api-server-count: one server on a Unix socket with prompt
embeddings enabled (the model's own embeddings of some ids answer as those ids do), and the refusal of N > 1 API
servers."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from pagedllm.engine.prompt_embeds import encode_prompt_embeds
from pagedllm.entrypoints.cli import main

IDS = [(i * 37 + 11) % 400 + 5 for i in range(20)]


@pytest.fixture(scope="module")
def uds_server(tiny_llm_dir: Path) -> Iterator[tuple[httpx.Client, Path]]:
    """`pagedllm serve --uds SOCKET --enable-prompt-embeds` and an httpx client of its socket."""
    folder = Path(tempfile.mkdtemp(prefix="pagedllm-uds-", dir="/tmp"))  # short: a socket path fits 107 bytes
    sock = folder / "api.sock"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(tiny_llm_dir), "--uds", str(sock),
           "--dtype", "float32", "--uvicorn-log-level", "warning", "--served-model-name", "tiny",
           "--enable-prompt-embeds"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://api.sock", timeout=60)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the server did not become healthy within 120 s"
                time.sleep(0.2)
        yield client, sock
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=30)
    assert not sock.exists(), "the socket file is removed when the server exits"


def test_serves_on_the_unix_socket(uds_server: tuple[httpx.Client, Path]) -> None:
    client, sock = uds_server
    assert sock.is_socket()
    assert client.get("/version").status_code == 200
    reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3})
    assert reply.status_code == 200, reply.text


def test_prompt_embeds_answer_as_their_token_ids(uds_server: tuple[httpx.Client, Path], tiny_llm_dir: Path) -> None:
    client, _ = uds_server
    table = load_file(str(tiny_llm_dir / "model.safetensors"))["model.embed_tokens.weight"]
    embeds = encode_prompt_embeds(table[IDS].float())
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0.0, "logprobs": 1}
    want = client.post("/v1/completions", json={**body, "prompt": IDS}).json()["choices"][0]
    got = client.post("/v1/completions", json={**body, "prompt": None, "prompt_embeds": embeds}).json()
    assert got["choices"][0]["text"] == want["text"]
    assert got["choices"][0]["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["usage"]["prompt_tokens"] == len(IDS)
    # the embeddings' choices first, then the prompt's (as vLLM's)
    mixed = client.post("/v1/completions", json={**body, "prompt": "Hello", "prompt_embeds": [embeds]}).json()
    assert [c["index"] for c in mixed["choices"]] == [0, 1] and mixed["choices"][0]["text"] == want["text"]
    # vLLM's test_completion_with_prompt_embeds.py (not collected here: it reads opt-125m from the hub): a batch of
    # two streamed, each choice finishing once; an empty prompt_embeds beside a prompt is none given
    stream = client.post("/v1/completions", json={**body, "prompt_embeds": [embeds, embeds], "stream": True})
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    assert stream.text.rstrip().endswith("data: [DONE]")
    assert sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]) == [0, 1]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == 0) == want["text"]
    plain = client.post("/v1/completions", json={**body, "prompt": "Hello", "prompt_embeds": []})
    assert plain.status_code == 200 and len(plain.json()["choices"]) == 1


@pytest.mark.parametrize(("extra", "param"), [
    ({"prompt_embeds": "invalid_base64"}, "prompt_embeds"),
    ({"prompt_embeds": encode_prompt_embeds(__import__("torch").zeros(2, 3))}, "prompt_embeds"),
    ({"prompt_embeds": encode_prompt_embeds(__import__("torch").zeros(2, 64)), "prompt_logprobs": 1},
     "prompt_logprobs"),
    ({"prompt_embeds": encode_prompt_embeds(__import__("torch").zeros(2, 64)), "echo": True}, "echo"),
    ({"prompt_embeds": []}, "prompt"),
])
def test_bad_prompt_embeds_are_400_naming_the_field(uds_server: tuple[httpx.Client, Path], extra: dict,
                                                    param: str) -> None:
    client, _ = uds_server
    reply = client.post("/v1/completions", json={"model": "tiny", "max_tokens": 2, **extra})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_api_server_count_above_one_is_refused(tiny_llm_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", str(tiny_llm_dir), "--api-server-count", "2"]) == 2  # before the engine loads
    assert "--api-server-count 2" in capsys.readouterr().err
