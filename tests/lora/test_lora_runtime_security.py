"""Run-time LoRA management is the operator's to allow: /v1/load_lora_adapter and /v1/unload_lora_adapter exist only
with --allow-runtime-lora-updating or PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING; the --lora-modules adapters cannot be
unloaded or replaced by clients; concurrent loads of one name leave one adapter, and so does a load_inplace (the
replaced adapter leaves the engine once its requests end); errors never quote the folder; --lora-modules' JSON form
takes vLLM's keys and refuses others."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pagedllm.entrypoints import cli
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.serving_models import (
    RUNTIME_LORA_ENV,
    LoRAModulePath,
    parse_lora_module,
    runtime_lora_updating,
)
from pagedllm.errors import ValidationError
from pagedllm.sampling_params import SamplingParams
from tests.utils import RemoteServer, thread_engine

SECRET = "SECRET123"
"""Planted in adapter folders: no error may quote it."""


def _env(value: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != RUNTIME_LORA_ENV}
    return env if value is None else {**env, RUNTIME_LORA_ENV: value}


def _load(url: str, name: str, path: str | Path) -> httpx.Response:
    return httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=30)


def _unload(url: str, name: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)


def _text(url: str, model: str) -> str:
    body = {"model": model, "prompt": "A list of fruits:", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def open_server(tiny_llm_dir: Path, adapters: Callable, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[RemoteServer, Path]]:
    """Run-time updating on through the variable; "first" is the operator's adapter. (server, its log file)"""
    log = tmp_path_factory.mktemp("open") / "server.log"
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", "--enable-lora", "--max-lora-rank", "16",
                       "--lora-modules", f"first={adapters('all-r8')[0]}", env=_env("1"), log=log)
    yield srv, log
    srv.stop()


def test_off_by_default_the_routes_do_not_exist(tiny_llm_dir: Path, adapters: Callable) -> None:
    srv = RemoteServer(tiny_llm_dir, "--served-model-name", "tiny", "--enable-lora", "--max-lora-rank", "16",
                       "--lora-modules", f"first={adapters('all-r8')[0]}", env=_env(None))
    try:
        before = _text(srv.url, "first")
        for r in (_load(srv.url, "other", adapters("attn-r2")[0]), _unload(srv.url, "first"),
                  _load(srv.url, "first", adapters("attn-r2")[0])):
            assert r.status_code == 404, r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        ids = [m["id"] for m in httpx.get(f"{srv.url}/v1/models", timeout=5).json()["data"]]
        assert ids == ["tiny", "first"]
        assert _text(srv.url, "first") == before
    finally:
        srv.stop()


def test_the_variable_takes_0_1_true_false_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, want in [(None, False), ("", False), ("0", False), ("false", False), ("FALSE", False), ("1", True),
                        ("true", True), ("True", True)]:
        if value is None:
            monkeypatch.delenv(RUNTIME_LORA_ENV, raising=False)
        else:
            monkeypatch.setenv(RUNTIME_LORA_ENV, value)
        assert runtime_lora_updating(False) is want, value
        assert runtime_lora_updating(True) is True  # the flag turns it on whatever the variable says
    for bad in ("yes", "2", "on"):
        monkeypatch.setenv(RUNTIME_LORA_ENV, bad)
        with pytest.raises(ValidationError) as err:
            runtime_lora_updating(True)
        assert err.value.param == RUNTIME_LORA_ENV and RUNTIME_LORA_ENV in str(err.value)


def test_serve_refuses_a_bad_value_and_updating_without_enable_lora(
        tiny_llm_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Both are refused before the model is loaded (exit status 2, the cause named)."""
    monkeypatch.setenv(RUNTIME_LORA_ENV, "yes")
    assert cli.main(["serve", str(tiny_llm_dir), "--enable-lora"]) == 2
    assert RUNTIME_LORA_ENV in capsys.readouterr().err
    monkeypatch.delenv(RUNTIME_LORA_ENV)
    assert cli.main(["serve", str(tiny_llm_dir), "--allow-runtime-lora-updating"]) == 2
    assert "needs --enable-lora" in capsys.readouterr().err


def test_on_with_the_variable_and_a_warning_at_start(open_server: tuple[RemoteServer, Path],
                                                     adapters: Callable) -> None:
    srv, log = open_server
    assert "run-time LoRA updating is on" in log.read_text()
    r = _load(srv.url, "extra", adapters("attn-r2")[0])
    assert r.status_code == 200, r.text
    assert _unload(srv.url, "extra").status_code == 200


def test_the_operators_adapter_cannot_be_unloaded_or_replaced(open_server: tuple[RemoteServer, Path],
                                                              adapters: Callable) -> None:
    srv, _ = open_server
    before = _text(srv.url, "first")
    for r in (_unload(srv.url, "first"), _load(srv.url, "first", adapters("attn-r2")[0]),
              _unload(srv.url, "tiny"), _load(srv.url, "tiny", adapters("attn-r2")[0])):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "lora_name" and error["type"] == "invalid_request_error"
    assert "cannot be unloaded" in _unload(srv.url, "first").json()["error"]["message"]
    assert "cannot be replaced" in _load(srv.url, "first", adapters("attn-r2")[0]).json()["error"]["message"]
    assert _text(srv.url, "first") == before  # still the operator's adapter


def test_concurrent_loads_of_one_name_one_wins(open_server: tuple[RemoteServer, Path], adapters: Callable) -> None:
    srv, _ = open_server
    paths = [adapters(name)[0] for name in ("attn-r2", "mlp-r16", "qv-r4-rslora", "attn-r2")]
    start = threading.Barrier(len(paths))

    def load(path: Path) -> httpx.Response:
        start.wait(timeout=10)
        return _load(srv.url, "race", path)

    with ThreadPoolExecutor(len(paths)) as pool:
        answers = list(pool.map(load, paths))
    assert sorted(r.status_code for r in answers) == [200, 400, 400, 400], [r.text for r in answers]
    assert all(r.json()["error"]["param"] == "lora_name" for r in answers if r.status_code == 400)
    ids = [m["id"] for m in httpx.get(f"{srv.url}/v1/models", timeout=5).json()["data"]]
    assert ids.count("race") == 1
    assert _unload(srv.url, "race").status_code == 200


def test_concurrent_loads_leave_one_adapter_in_the_engine(tiny_llm_dir: Path, adapters: Callable) -> None:
    """In process, so the engine's own list of adapters can be read: four loads of one name at once, one id more."""
    engine = thread_engine(tiny_llm_dir, enable_lora=True, max_lora_rank=16)
    app = build_app(engine, ServerMetrics("tiny"), ["tiny"], [], lora_modules=[
        LoRAModulePath("first", str(adapters("all-r8")[0]))], allow_runtime_lora_updating=True)
    paths = [str(adapters(name)[0]) for name in ("attn-r2", "mlp-r16", "qv-r4-rslora", "attn-r2")]

    async def run() -> tuple[list[int], set[int]]:
        engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                answers = await asyncio.gather(*[client.post("/v1/load_lora_adapter",
                                                             json={"lora_name": "race", "lora_path": p})
                                                 for p in paths])
                ids = set(await engine.list_loras())
            return sorted(r.status_code for r in answers), ids
        finally:
            await engine.shutdown()

    codes, ids = asyncio.run(run())
    assert codes == [200, 400, 400, 400]
    assert len(ids) == 2  # the operator's adapter and the one winner: no orphans


def test_load_inplace_retires_the_old_adapter_once_its_request_ends(tiny_llm_dir: Path, adapters: Callable) -> None:
    """In process: a request runs with the old adapter while load_inplace replaces it; it runs to its end, and the
    engine then holds the new adapter only."""
    engine = thread_engine(tiny_llm_dir, enable_lora=True, max_lora_rank=16)
    app = build_app(engine, ServerMetrics("tiny"), ["tiny"], [], allow_runtime_lora_updating=True)
    models = app.state.models

    async def run() -> tuple[int, set[int], set[int], int]:
        engine.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                load = lambda path, inplace: client.post("/v1/load_lora_adapter", json={  # noqa: E731
                    "lora_name": "a", "lora_path": str(adapters(path)[0]), "load_inplace": inplace})
                assert (await load("attn-r2", False)).status_code == 200
                old = models.loras["a"]
                stream = await engine.add_request("long", "Once upon a time", SamplingParams(
                    max_tokens=300, ignore_eos=True, temperature=0.0), lora_request=old)
                outputs = stream.__aiter__()
                await outputs.__anext__()  # it runs
                status = (await load("mlp-r16", True)).status_code
                new = models.loras["a"]
                last = None
                async for last in outputs:  # noqa: B007 (the last output is read after the loop)
                    pass
                for _ in range(100):  # the old one leaves within a few RETIRE_POLL_S
                    if await engine.list_loras() == {new.lora_int_id}:
                        break
                    await asyncio.sleep(0.1)
                return status, {old.lora_int_id}, await engine.list_loras(), len(last.outputs[0].token_ids)
        finally:
            await engine.shutdown()

    status, old_ids, ids, generated = asyncio.run(run())
    assert status == 200
    assert generated == 300  # the running request was not cut short
    assert len(ids) == 1 and not ids & old_ids  # only the new adapter is left


@pytest.mark.parametrize("text, error", [
    ('{"name": "a", "path": "/x", "dtype": "bf16"}', "['dtype'] not supported"),
    ('{"name": "a", "path": "/x", "is_3d_lora_weight": true}', "is_3d_lora_weight"),
    ('{"name": "a", "path": "/x", "base_model_name": 3}', "base_model_name"),
    ('["a", "/x"]', "expected name=path"), ('{"name": "a"}', "expected name=path"),
])
def test_lora_modules_json_takes_vllms_keys_only(text: str, error: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(error)):
        parse_lora_module(text)
    assert parse_lora_module('{"name": "a", "path": "/x", "base_model_name": "m", "is_3d_lora_weight": false}') == \
        LoRAModulePath("a", "/x", "m")
    assert parse_lora_module("a=/x") == LoRAModulePath("a", "/x")


def test_lora_modules_base_model_name_must_be_served(tiny_llm_dir: Path, adapters: Callable) -> None:
    engine = thread_engine(tiny_llm_dir, enable_lora=True, max_lora_rank=16)
    module = LoRAModulePath("first", str(adapters("all-r8")[0]), base_model_name="other")
    with pytest.raises(ValidationError, match="not a served model name") as err:
        build_app(engine, ServerMetrics("tiny"), ["tiny"], [], lora_modules=[module])
    assert err.value.param == "lora_modules"


def _bad_folders(base: Path, out: Path) -> dict[str, Path]:
    """Adapter folders whose config or weights hold SECRET where our checks read."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "adapter_config.json").read_text())
    cases: dict[str, bytes | dict | list | None] = {
        "r": {**config, "r": SECRET, "target_modules": SECRET}, "peft_type": {**config, "peft_type": SECRET},
        "lora_alpha": {**config, "lora_alpha": SECRET}, "bias": {**config, "bias": SECRET},
        "not json": f"{{{SECRET}".encode(), "not utf-8": b"\xff\xfe" + SECRET.encode(), "a list": [SECRET],
        "huge": {**config, "bogus": SECRET * 200_000}, "weights": None, "tensor name": None,
    }
    folders = {}
    for name, content in cases.items():
        folder = out / name.replace(" ", "_")
        shutil.copytree(base, folder)
        if isinstance(content, bytes):
            (folder / "adapter_config.json").write_bytes(content)
        elif content is not None:
            (folder / "adapter_config.json").write_text(json.dumps(content))
        folders[name] = folder
    (folders["weights"] / "adapter_model.safetensors").write_bytes(SECRET.encode() * 10)
    save_file({f"base_model.model.{SECRET}.lora_A.weight": torch.zeros(2, 2)},
              str(folders["tensor name"] / "adapter_model.safetensors"))
    return folders


def test_errors_never_quote_the_adapter_folder(open_server: tuple[RemoteServer, Path], adapters: Callable,
                                               tmp_path: Path) -> None:
    srv, _ = open_server
    for case, folder in _bad_folders(adapters("attn-r2")[0], tmp_path).items():
        r = _load(srv.url, f"bad-{case}".replace(" ", "-"), folder)
        assert r.status_code == 400, (case, r.text)
        assert SECRET not in r.text, (case, r.text)
        error = r.json()["error"]
        assert error["param"] == "lora_request" and "is not a valid LoRA adapter folder" in error["message"], case
        assert str(folder) in error["message"]  # the path the client sent, nothing else of the disk
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
