"""The live KV-cache map: /kv/state's JSON against /metrics, and the /kv page loaded in headless Chromium
(Debian's `chromium`, driven by Playwright) while requests run: its screenshot shows held blocks, and the
counts it prints are the /kv/state sample it drew; once idle, the page, /kv/state and /metrics agree."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.utils import RemoteServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = Path(os.environ.get("PAGEDLLM_KV_SCREENSHOT", "")) if os.environ.get("PAGEDLLM_KV_SCREENSHOT") else None
"""Where to keep the screenshot taken under load (docs/kv_page.png is one); a temporary file otherwise."""


@pytest.fixture(scope="module")
def kv_server(tiny_llm_dir: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llm_dir, "--num-kv-blocks", "400", "--max-num-seqs", "32", "--served-model-name", "tiny",
                       "--step-log", str(tiny_llm_dir.parent / "kv-server-steps.jsonl"))
    yield srv
    srv.stop()


def _load(srv: RemoteServer, seconds: float) -> threading.Thread:
    """Streams for ``seconds``: a shared 40-token prefix (prefix cache), n = 2 samples, plain prompts."""
    async def run() -> None:
        shared = " ".join(f"w{i}" for i in range(40))
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as client:
            async def one(i: int) -> None:
                while loop.time() < end:
                    body = {"model": "tiny", "prompt": f"{shared} q{i}" if i % 2 else f"plain {i}", "max_tokens": 200,
                            "ignore_eos": True, "n": 2 if i % 3 == 0 else 1, "temperature": 1.0}
                    await client.post(f"{srv.url}/v1/completions", json=body)
            await asyncio.gather(*(one(i) for i in range(12)))

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    return thread


def _step_log(srv: RemoteServer) -> str:
    """The --step-log file of the kv_server fixture (its last argument)."""
    return srv.proc.args[-1]


def _check_accounting(state: dict) -> None:
    a, bs = state["accounting"], state["block_size"]
    assert a["used_blocks"] + a["free_blocks"] == a["usable_blocks"] == state["num_blocks"] - 1
    assert a["token_states"] + a["internal_fragmentation"] + a["reserved"] == a["used_blocks"] * bs
    assert a["used_blocks"] == sum(1 for r in state["refs"][1:] if r > 0)


def test_kv_state_and_metrics(kv_server: RemoteServer) -> None:
    load = _load(kv_server, 3.0)
    busy = []
    while load.is_alive():
        state = httpx.get(f"{kv_server.url}/kv/state", timeout=10).json()
        _check_accounting(state)
        busy.append(state["accounting"])
    assert max(a["used_blocks"] for a in busy) > 0 and max(a["shared_blocks"] for a in busy) > 0
    state = httpx.get(f"{kv_server.url}/kv/state", timeout=10).json()  # idle now: nothing moves
    a = state["accounting"]
    assert a["used_blocks"] == 0 and a["cached_free"] > 0 and state["history"] and state["integrity"] == "ok"
    assert kv_server.metric("pagedllm:kv_cache_usage_perc") == a["used_blocks"] / a["usable_blocks"]
    assert kv_server.metric("pagedllm:num_requests_running") == 0 == len(state["requests"])
    assert max(h["used_blocks"] for h in state["history"]) > 0  # the chart's data saw the load
    steps = [json.loads(line) for line in Path(_step_log(kv_server)).read_text().splitlines()]
    assert len(steps) > 10 and all(len(s["features"]) == 4 and s["seconds"] > 0 for s in steps)  # --step-log


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (`apt-get install chromium`: make test installs it "
                                              "where it may)")
def test_kv_page_in_headless_chromium(kv_server: RemoteServer, tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    shot = SCREENSHOT or tmp_path / "kv.png"
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 900})
            load = _load(kv_server, 6.0)
            page.goto(f"{kv_server.url}/kv")
            drawn = None
            for _ in range(20):  # the page's own samples, until one shows blocks in use
                with page.expect_response(lambda r: r.url.endswith("/kv/state"), timeout=10_000) as response:
                    pass
                sample = json.loads(response.value.text())
                page.wait_for_function(f"document.body.dataset.updated === '{sample['time']}'", timeout=10_000)
                if sample["accounting"]["used_blocks"] > 10 and sample["accounting"]["shared_blocks"] > 0:
                    drawn = sample
                    break
            assert drawn is not None, "the page never drew blocks in use"
            _check_dom(page, drawn)
            page.screenshot(path=str(shot))
            pixels = page.evaluate("""() => {
                const c = document.getElementById('grid'),
                      d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let coloured = 0;
                for (let i = 0; i < d.length; i += 4)
                    if (Math.max(d[i], d[i + 1], d[i + 2]) - Math.min(d[i], d[i + 1], d[i + 2]) > 60) coloured++;
                return coloured; }""")
            assert pixels > 1000  # held blocks are drawn in their requests' colours
            load.join(timeout=60)
            state = httpx.get(f"{kv_server.url}/kv/state", timeout=10).json()
            page.wait_for_function(f"Number(document.body.dataset.updated) > {state['time']}", timeout=10_000)
            _check_dom(page, state)  # idle: the page, /kv/state and /metrics say the same
            assert page.inner_text("#usage") == f"{100 * kv_server.metric('pagedllm:kv_cache_usage_perc'):.1f}%"
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000


def _check_dom(page, state: dict) -> None:  # noqa: ANN001
    a = state["accounting"]
    shown = {key: int(page.inner_text(f"#{key.replace('_', '-')}")) for key in
             ("used_blocks", "shared_blocks", "free_blocks", "token_states", "internal_fragmentation", "reserved",
              "free")}
    assert shown == {key: a[key] for key in shown}
    assert int(page.inner_text("#requests")) == len(state["requests"])
    assert int(page.inner_text("#cached-free-blocks")) == a["cached_free"] // state["block_size"]
