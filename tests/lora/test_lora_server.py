"""LoRA adapters through a real `pagedllm serve` and the official openai client: --lora-modules listed in
/v1/models and chosen by the request's model, adapters loaded and unloaded at run time, concurrent
requests of different adapters (and the base model) answered as the offline engine answers each."""
from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.utils import RemoteServer

PROMPTS = ["Tell me about the sea", "A list of fruits:", "Once upon a time"]


@pytest.fixture(scope="module")
def lora_server(tiny_llm_dir: Path, adapters: Callable) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2",
                       "--max-lora-rank", "16", "--allow-runtime-lora-updating",
                       "--lora-modules", f"first={adapters('all-r8')[0]}",
                       '{"name": "second", "path": "%s"}' % adapters("qv-r4-rslora")[0])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_llm_dir: Path, adapters: Callable) -> Callable[[str | None, str], str]:
    """(adapter name or None, prompt) -> the offline engine's greedy text of 8 tokens."""
    llm = LLM(str(tiny_llm_dir), dtype="float32", enable_lora=True, max_lora_rank=16, num_kv_blocks=128)
    paths = {"first": "all-r8", "second": "qv-r4-rslora", "third": "mlp-r16"}
    ids = {name: i + 1 for i, name in enumerate(paths)}
    cache: dict[tuple[str | None, str], str] = {}

    def run(adapter: str | None, prompt: str) -> str:
        if (adapter, prompt) not in cache:
            lora = None if adapter is None else LoRARequest(adapter, ids[adapter], str(adapters(paths[adapter])[0]))
            out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                               use_tqdm=False, lora_request=lora)
            cache[adapter, prompt] = out[0].outputs[0].text
        return cache[adapter, prompt]

    yield run
    llm.shutdown()


def _complete(client: openai.OpenAI, model: str, prompt: str) -> str:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_models_lists_the_adapters(lora_server: RemoteServer, adapters: Callable) -> None:
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="x")
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == ["tiny", "first", "second"]
    assert cards["first"].model_extra["parent"] == "tiny" and cards["tiny"].model_extra["parent"] is None
    # no filesystem path shown: each root is its folder's name
    assert cards["first"].model_extra["root"] == adapters("all-r8")[0].name, cards["first"]
    assert all("/" not in card.model_extra["root"] for card in cards.values()), cards


def test_concurrent_requests_of_different_adapters(lora_server: RemoteServer, offline: Callable) -> None:
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="x")
    jobs = [(model, prompt) for model in ("first", "tiny", "second") for prompt in PROMPTS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: _complete(client, *job), jobs))
    want = [offline(None if model == "tiny" else model, prompt) for model, prompt in jobs]
    assert got == want
    assert len({got[0], got[3], got[6]}) == 3  # the adapters change the text
    chat = client.chat.completions.create(model="second", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0.0)
    assert chat.model == "second" and chat.choices[0].message.content is not None


def test_load_and_unload_at_run_time(lora_server: RemoteServer, adapters: Callable, offline: Callable,
                                     tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="x")
    url = lora_server.url
    path = str(adapters("mlp-r16")[0])
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": path}, timeout=30)
    assert r.status_code == 200, r.text
    assert "third" in [m.id for m in client.models.list().data]
    assert _complete(client, "third", PROMPTS[0]) == offline("third", PROMPTS[0])
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": path}, timeout=30)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)},
                     timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_request"
    assert "adapter_config.json" in bad.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "third"}, timeout=30)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "third", PROMPTS[0])
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "third"}, timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    assert _complete(client, "first", PROMPTS[1]) == offline("first", PROMPTS[1])  # the others still serve
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_lora_modules_need_enable_lora(tiny_llm_dir: Path, adapters: Callable) -> None:
    with pytest.raises(RuntimeError, match="--lora-modules needs --enable-lora"):
        RemoteServer(tiny_llm_dir, "--lora-modules", f"first={adapters('all-r8')[0]}")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_adapter_with_nan_or_inf_weights_is_refused(lora_server: RemoteServer, adapters: Callable,
                                                       tmp_path: Path, bad: float) -> None:
    from safetensors.torch import load_file, save_file

    source = adapters("attn-r2")[0]
    shutil.copytree(source, tmp_path / "broken")
    weights = tmp_path / "broken" / "adapter_model.safetensors"
    tensors = load_file(weights)
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key][0, 0] = bad  # one value: every output of that layer would be NaN
    save_file(tensors, weights)
    r = httpx.post(f"{lora_server.url}/v1/load_lora_adapter",
                   json={"lora_name": "broken", "lora_path": str(tmp_path / "broken")}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "lora_request" and "NaN or infinite" in error["message"], error
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="x")
    assert "broken" not in [m.id for m in client.models.list().data]
    assert _complete(client, "first", PROMPTS[0])  # still serving
