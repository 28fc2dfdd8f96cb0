"""The pytest plugin (``-p vllm_shim.plugin``) under which vLLM's server tests run against ``pagedllm serve``.

At import (before any conftest of vLLM's is read) it installs the stand-in ``vllm`` package and our
``remote.py`` as ``tests.utils``. While tests run it notes, per test, whether any HTTP request went to a server
the shim started (httpx, which the openai and anthropic SDKs use, and requests), and its outcome; files that fail
to import (vLLM internals, vLLM's other test helpers) are recorded with the reason. At the end it writes
everything as JSON to ``$VLLM_SHIM_OUT``."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from . import fake_vllm, remote

ROOT = Path(os.environ.get("VLLM_SHIM_ROOT", ".")).resolve()
_reached: list[bool] = [False]
_results: dict[str, dict[str, Any]] = {}
_collect_errors: list[dict[str, str]] = []
_collected: dict[str, int] = {}


def _install() -> None:
    """The stand-in vllm, then vLLM's `tests` package with our module as its `utils`."""
    fake_vllm.install()
    sys.path.insert(0, str(ROOT))
    import tests  # vLLM's tests/__init__.py, from the unpacked source package

    sys.modules["tests.utils"] = remote
    tests.utils = remote  # type: ignore[attr-defined]


def _note(url: Any) -> None:
    parts = urlsplit(str(url))
    if parts.port in remote.LIVE_PORTS or (parts.port is None and parts.hostname in remote.LIVE_UDS_HOSTS):
        _reached[0] = True


def _wrap(cls: Any, is_async: bool) -> None:
    """Note each request ``cls.send`` sends to one of the shim's servers."""
    original = cls.send
    if is_async:
        async def send(self: Any, request: Any, *args: Any, **kw: Any) -> Any:
            _note(request.url)
            return await original(self, request, *args, **kw)
    else:
        def send(self: Any, request: Any, *args: Any, **kw: Any) -> Any:
            _note(request.url)
            return original(self, request, *args, **kw)
    cls.send = send


def _watch_http() -> None:
    """Wrap the HTTP clients' send methods: httpx, httpx2 (the openai and anthropic SDKs' own), requests."""
    import importlib

    for name in ("httpx", "httpx2"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        _wrap(module.Client, False)
        _wrap(module.AsyncClient, True)
    import requests

    _wrap(requests.Session, False)


_install()
_watch_http()


#: A failure that comes from vLLM's own code or test helpers, not from a server: a placeholder of vLLM's code
#: used, vLLM's top-level conftest fixtures (offline LLM, HF reference runners, asset servers), vLLM launched
#: directly, the shim's test helper itself under test.
_INTERNAL = re.compile(r"VllmInternal|_Internal\b|fixture '\w+' not found|No module named 'vllm|"
                       r"module named 'tests\.|vllm_shim\.remote' has no attribute|object has no attribute '_get_")


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def _short(text: str) -> str:
    """The error lines (`E   ...`) of a failure, else its last line, on one line and bounded."""
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    if not lines:
        lines = [ln.strip() for ln in text.strip().splitlines()[-1:]]
    return re.sub(r"\s+", " ", " | ".join(lines[:4]))[:600]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Count the tests of each file."""
    for item in items:
        _collected[_file(item.nodeid)] = _collected.get(_file(item.nodeid), 0) + 1


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A file that did not import: its reason."""
    if report.failed:
        _collect_errors.append({"file": _file(report.nodeid), "reason": _short(report.longreprtext)})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A new test: nothing reached yet."""
    _reached[0] = False
    remote.CURRENT["file"] = _file(item.nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Fold each phase's report into the test's outcome."""
    entry = _results.setdefault(report.nodeid, {"nodeid": report.nodeid, "file": _file(report.nodeid),
                                                "outcome": "passed", "reason": "", "reached": False,
                                                "seconds": 0.0})
    entry["seconds"] = round(entry["seconds"] + report.duration, 2)
    entry["reached"] = entry["reached"] or _reached[0]
    if report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        longrepr = report.longrepr
        entry["reason"] = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr).removeprefix("Skipped: ")
    elif report.failed and entry["outcome"] in ("passed", "skipped"):
        text = report.longreprtext
        entry["outcome"] = ("internal" if _INTERNAL.search(text) else
                            "failed" if report.when == "call" else "error")
        entry["reason"] = _short(text)


def pytest_runtest_logfinish(nodeid: str) -> None:
    """Every 25 tests, the results so far (a long run can be read, or summarized, before it ends)."""
    if len(_results) % 25 == 0:
        pytest_sessionfinish(None)


def pytest_sessionfinish(session: pytest.Session | None) -> None:
    """Everything, as JSON, to $VLLM_SHIM_OUT."""
    out = os.environ.get("VLLM_SHIM_OUT")
    if not out:
        return
    data = {"tests": list(_results.values()), "collect_errors": _collect_errors, "collected": _collected,
            "server_starts": remote.STARTS}
    part = Path(out + ".part")
    part.write_text(json.dumps(data, indent=1))
    os.replace(part, out)
