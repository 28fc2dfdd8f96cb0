"""Data parallelism with real replica processes (engine/dp_client.py): greedy tokens equal to one engine's (mp and
Ray; two Ray nodes holding one replica each), a multi-turn chat's later turns back on its first turn's replica,
and a replica SIGKILLed under load: its streams end in an error event, the other's finish, the server stays up
(degraded, then restarted), and nothing is left behind."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.local_core import CORE_MODULE
from pagedllm.errors import ValidationError
from tests.distributed.test_faults import _assert_gone
from tests.distributed.test_ray_cluster import two_node_cluster  # noqa: F401  (a fixture)
from tests.distributed.utils import ray_auth_disabled, shm_segments
from tests.entrypoints.openai.test_kv_page import CHROMIUM
from tests.utils import RemoteServer

PROMPTS = [f"Data parallel prompt {i} " + "with more words " * (i % 4) for i in range(10)]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


def _cores(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True)
            if "pagedllm.engine.core_proc" in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def reference(tiny_llm_dir: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llm_dir), dtype="float32")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("backend, tp", [("mp", 1), ("ray", 1), ("mp", 2)])
def test_offline_replicas_give_one_engines_tokens_in_input_order(tiny_llm_dir: Path, reference: list, backend: str,
                                                                 tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """dp=2 (each replica with its own tensor-parallel group at tp=2) gives one engine's greedy tokens."""
    ray_auth_disabled(monkeypatch)
    llm = LLM(str(tiny_llm_dir), dtype="float32", data_parallel_size=2, data_parallel_backend=backend,
              tensor_parallel_size=tp, num_kv_blocks=24)
    try:
        states = llm.llm_engine.engine_core.replica_states()
        assert [s["status"] for s in states] == ["running", "running"] and states[0]["pid"] != states[1]["pid"]
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert [o.request_id for o in outs] == [str(i) for i in range(len(PROMPTS))]
        stats = llm.get_stats()
        assert stats.num_generated_tokens == sum(map(len, reference)) and stats.num_kv_blocks > 0
        assert len(llm.llm_engine.rank_memory_usage()) == 2 * tp  # every rank of every replica
        too_long = {"prompt_token_ids": [5] * 400}  # 25 blocks: more than a replica's pool holds
        with pytest.raises(ValidationError, match="KV"):  # a replica's refusal reaches the caller ...
            llm.generate(PROMPTS[:3] + [too_long], GREEDY, use_tqdm=False)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # ... and nothing of that call lingers
        assert [o.outputs[0].token_ids for o in outs] == reference
        if backend == "mp" and len(os.sched_getaffinity(0)) >= 2:  # each replica on its own cores
            assert not set(states[0]["cores"]) & set(states[1]["cores"]), states
        pids = [p.pid for s in states for p in [psutil.Process(s["pid"])] + psutil.Process(s["pid"]).children()]
    finally:
        llm.shutdown()
    _assert_gone([psutil.Process(p) for p in pids if psutil.pid_exists(p)])
    import ray
    assert not ray.is_initialized()


def test_two_ray_nodes_hold_one_replica_each(two_node_cluster: str, tiny_llm_dir: Path,  # noqa: F811
                                              reference: list) -> None:
    llm = LLM(str(tiny_llm_dir), dtype="float32", data_parallel_size=2, data_parallel_backend="ray")
    try:
        states = llm.llm_engine.engine_core.replica_states()
        assert len({s["node_id"] for s in states}) == 2, states
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        cores = [psutil.Process(s["pid"]) for s in states]
    finally:
        llm.shutdown()
    _assert_gone(cores)  # their actors were killed, and the cores died with them


def _engine_counters(srv: RemoteServer, name: str) -> dict[str, float]:
    """A per-engine Prometheus counter: engine label -> value."""
    found = {}
    for line in httpx.get(f"{srv.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"pagedllm:{name}_total{{"):
            found[line.split('engine="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return found


def test_a_conversation_returns_to_its_replica(tiny_llm_dir: Path) -> None:
    """Two conversations, three turns each, one request at a time: every later turn runs on the replica of its
    first turn (the only engine whose prompt counter moved) and finds its history there (prefix hits)."""
    srv = RemoteServer(tiny_llm_dir, "--data-parallel-size", "2", "--served-model-name", "tiny")
    try:
        cores = [p for p in psutil.Process(srv.proc.pid).children() if CORE_MODULE in p.cmdline()]
        assert len(cores) == 2, cores  # one per replica: the core `serve` started first was let go
        client = srv.get_client()
        conversations = {name: [{"role": "system", "content": "You answer briefly."},
                                {"role": "user", "content": f"Conversation {name}: " + f"{name} story " * 40}]
                         for name in ("alpha", "beta")}
        home: dict[str, str] = {}
        for turn in range(3):
            for name, messages in conversations.items():
                queries, hits = _engine_counters(srv, "prefix_cache_queries"), _engine_counters(srv,
                                                                                              "prefix_cache_hits")
                reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                                       temperature=0)
                moved = {e: v - queries[e] for e, v in _engine_counters(srv, "prefix_cache_queries").items()
                         if v != queries[e]}
                assert len(moved) == 1, moved
                [engine] = moved
                if turn == 0:
                    home[name] = engine
                else:
                    hit = _engine_counters(srv, "prefix_cache_hits")[engine] - hits[engine]
                    assert engine == home[name] and hit >= 16 * 3, (name, turn, engine, home, hit)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": f"Turn {turn + 2} of {name}, go on."}]
        assert home["alpha"] != home["beta"]  # the idle server spread the first turns
        kv = httpx.get(f"{srv.url}/kv/state", timeout=10).json()  # one map per replica, each holding its history
        assert [r["index"] for r in kv["replicas"]] == [0, 1]
        assert all(r["integrity"] == "ok" and r["accounting"]["cached_free"] > 0 for r in kv["replicas"]), kv
        if CHROMIUM is not None:
            _kv_page_shows_each_replica(srv, kv)
    finally:
        srv.stop()


def _kv_page_shows_each_replica(srv: RemoteServer, kv: dict) -> None:
    """The /kv page offers one map per replica and draws the one chosen."""
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            page.goto(f"{srv.url}/kv")
            page.wait_for_function("document.body.dataset.updated !== undefined", timeout=10_000)
            assert page.is_visible("#replicas")
            assert page.eval_on_selector_all("#replica-select option", "os => os.map(o => o.value)") == ["0", "1"]
            for index in (1, 0):
                page.select_option("#replica-select", str(index))
                drawn = page.evaluate("document.body.dataset.updated")
                page.wait_for_function(f"document.body.dataset.updated !== '{drawn}'", timeout=10_000)
                want = kv["replicas"][index]["accounting"]["cached_free"] // kv["replicas"][index]["block_size"]
                assert page.inner_text("#cached-free-blocks") == str(want)  # idle: the map it was given
        finally:
            browser.close()


def _stream(url: str, i: int, ends: list[str], started: threading.Event) -> None:
    """A long stream: its end ("error" or the finish reason) into ``ends``."""
    body = {"prompt": f"replica fault {i} " * (i + 1), "max_tokens": 450, "stream": True, "ignore_eos": True}
    end = "cut"
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                started.set()
                if "error" in event:
                    end = "error: " + event["error"]["message"]
                    break
                if event["choices"][0]["finish_reason"]:
                    end = event["choices"][0]["finish_reason"]
    except httpx.HTTPError as e:
        end = f"cut: {e!r}"
    ends.append(end)


def test_a_killed_replica_fails_its_streams_alone_and_comes_back(tiny_llm_dir: Path) -> None:
    shm_before = shm_segments()
    srv = RemoteServer(tiny_llm_dir, "--data-parallel-size", "2", "--data-parallel-restart")
    try:
        health = httpx.get(f"{srv.url}/health", timeout=5).json()
        assert health["status"] == "ok" and [r["status"] for r in health["replicas"]] == ["running"] * 2
        assert "pid" not in health["replicas"][0]  # /health is open to anyone: no pids or addresses
        [victim] = [p.pid for p in _cores(srv.proc.pid) if p.cmdline()[-2:] == ["--cores", "0"]]  # replica 0
        ends: list[str] = []
        started = [threading.Event() for _ in range(4)]
        threads = [threading.Thread(target=_stream, args=(srv.url, i, ends, started[i]), daemon=True)
                   for i in range(4)]
        for t in threads:
            t.start()
        assert all(s.wait(30) for s in started)
        everything = psutil.Process(srv.proc.pid).children(recursive=True)
        psutil.Process(victim).send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 20
        while "status -9" not in (state := httpx.get(f"{srv.url}/health", timeout=5)).json()["replicas"][0].get(
                "error", ""):
            assert time.monotonic() < deadline, state.text
            time.sleep(0.05)
        assert state.status_code == 200 and state.json()["status"] == "degraded"
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "still up?", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text  # new requests go to the replica left
        for t in threads:
            t.join(60)
        assert sorted(e.split(":")[0] for e in ends) == ["error", "error", "length", "length"], ends
        assert all("replica serving it stopped" in e for e in ends if e.startswith("error")), ends
        deadline = time.monotonic() + 60
        while (state := httpx.get(f"{srv.url}/health", timeout=5).json())["status"] != "ok":
            assert time.monotonic() < deadline, state
            time.sleep(0.2)
        assert state["replicas"][0]["restarts"] == 1 and victim not in [p.pid for p in _cores(srv.proc.pid)]
        for prompt in ("after the restart", "and another"):
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": prompt, "max_tokens": 3}, timeout=30)
            assert r.status_code == 200, r.text
        srv.wait_idle()
        everything += psutil.Process(srv.proc.pid).children(recursive=True)
    finally:
        srv.stop()
    assert srv.proc.returncode == 0
    _assert_gone(everything)
    assert shm_segments() <= shm_before
