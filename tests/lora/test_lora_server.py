"""LoRA adapters through a real `pagedllm serve` and the official openai client: --lora-modules listed in
/v1/models and chosen by the request's model, adapters loaded and unloaded at run time (and replaced with
load_inplace, as vLLM), SageMaker's /adapters routes and adapter header, concurrent requests of different adapters
(and the base model) answered as the offline engine answers each."""
from __future__ import annotations

import json
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
                       json.dumps({"name": "second", "path": str(adapters("qv-r4-rslora")[0]),
                                   "base_model_name": "tiny"}))
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
    assert cards["second"].model_extra["parent"] == "tiny"  # (vLLM's base_model_name, given in its JSON form)
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
    assert "already been loaded" in again.json()["error"]["message"]  # (vLLM's words: its clients match them)
    # no adapter_config.json, or no folder at all: one 404, as vLLM's (no hint of which folders exist)
    for missing in (tmp_path, tmp_path / "nowhere"):
        bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(missing)},
                         timeout=30)
        assert bad.status_code == 404, bad.text
        error = bad.json()["error"]
        assert error["param"] == "lora_path" and error["code"] == "adapter_not_found", error
        assert "adapter_config.json" in error["message"] and str(missing) in error["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "third"}, timeout=30)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "third", PROMPTS[0])
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "third"}, timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    assert _complete(client, "first", PROMPTS[1]) == offline("first", PROMPTS[1])  # the others still serve
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_load_inplace_replaces_an_adapter(lora_server: RemoteServer, adapters: Callable, offline: Callable) -> None:
    """vLLM's load_inplace: the name stays, the weights are the new folder's (the old ones leave the engine)."""
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="x")
    load = lambda name, body: httpx.post(f"{lora_server.url}/v1/load_lora_adapter",  # noqa: E731
                                         json={"lora_name": name, **body}, timeout=30)
    assert load("swap", {"lora_path": str(adapters("mlp-r16")[0])}).status_code == 200
    assert _complete(client, "swap", PROMPTS[0]) == offline("third", PROMPTS[0])
    refused = load("swap", {"lora_path": str(adapters("all-r8")[0]), "load_inplace": False})
    assert refused.status_code == 400 and "already been loaded" in refused.json()["error"]["message"]
    r = load("swap", {"lora_path": str(adapters("all-r8")[0]), "load_inplace": True})
    assert r.status_code == 200, r.text
    assert _complete(client, "swap", PROMPTS[0]) == offline("first", PROMPTS[0])  # the new weights
    assert [m.id for m in client.models.list().data].count("swap") == 1
    # a replacement that fails leaves the adapter as it was
    assert load("swap", {"lora_path": "/no/such/adapter", "load_inplace": True}).status_code == 404
    assert _complete(client, "swap", PROMPTS[1]) == offline("first", PROMPTS[1])
    # the operator's adapters stay theirs, load_inplace or not
    assert load("first", {"lora_path": str(adapters("mlp-r16")[0]), "load_inplace": True}).status_code == 400
    assert load("swap", {"lora_path": str(adapters("all-r8")[0]), "load_inplace": "yes"}).status_code == 400
    assert httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "swap"},
                      timeout=30).status_code == 200


def test_sagemaker_adapter_routes(lora_server: RemoteServer, adapters: Callable, offline: Callable) -> None:
    """SageMaker's POST /adapters {name, src} and DELETE /adapters/{name} (as vLLM's, with run-time updating on);
    /invocations runs the adapter its X-Amzn-SageMaker-Adapter-Identifier header names."""
    url = lora_server.url
    r = httpx.post(f"{url}/adapters", json={"name": "sm", "src": str(adapters("mlp-r16")[0])}, timeout=30)
    assert r.status_code == 200 and r.text == "Adapter sm registered", r.text
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
    card = next(m for m in client.models.list().data if m.id == "sm")
    assert card.model_extra["parent"] == "tiny"
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    invoked = httpx.post(f"{url}/invocations", json=body, headers={"X-Amzn-SageMaker-Adapter-Identifier": "sm"},
                         timeout=60)
    assert invoked.status_code == 200, invoked.text
    assert invoked.json()["model"] == "sm" and invoked.json()["choices"][0]["text"] == offline("third", PROMPTS[0])
    unknown = httpx.post(f"{url}/invocations", json=body, headers={"X-Amzn-SageMaker-Adapter-Identifier": "nope"},
                         timeout=30)
    assert unknown.status_code == 404
    assert httpx.post(f"{url}/adapters", json={"name": "sm2", "src": "/no/such/adapter"},
                      timeout=30).status_code == 404
    for extra in ({"pinned": True}, {"preload": False}):
        refused = httpx.post(f"{url}/adapters", json={"name": "sm2", "src": str(adapters("mlp-r16")[0]), **extra},
                             timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == next(iter(extra)), refused.text
    gone = httpx.delete(f"{url}/adapters/sm", timeout=30)
    assert gone.status_code == 200 and gone.text == "Adapter sm unregistered"
    assert "sm" not in [m.id for m in client.models.list().data]
    assert httpx.delete(f"{url}/adapters/sm", timeout=30).status_code == 404
    assert httpx.delete(f"{url}/adapters/first", timeout=30).status_code == 400  # the operator's


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
