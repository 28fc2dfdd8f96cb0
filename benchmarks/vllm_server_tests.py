"""Run vLLM's own server tests (``tests/entrypoints/`` and ``tests/tool_use/`` of vLLM 0.34.0's source package,
pinned by its sha256) against ``pagedllm serve``, through our shim (``benchmarks/vllm_shim/``), and summarize what
passes, what fails (a feature we lack, a behaviour that differs) and what is skipped and why.

    .venv/bin/python benchmarks/vllm_server_tests.py                       # everything (an hour or more)
    .venv/bin/python benchmarks/vllm_server_tests.py -k "chat and not stream" --paths tests/entrypoints/openai
    .venv/bin/python benchmarks/vllm_server_tests.py --summarize out/vllm_server_tests/raw.json  # rewrite the summary

The source package is downloaded once into the cache (to a temporary name, checked against its hash, then
renamed: a killed download leaves nothing half-written behind) and only its test folders are unpacked (the same
way). vLLM's ``tests/utils.py`` and ``tests/conftest.py`` are not unpacked: the shim stands in for them
(``RemoteOpenAIServer`` starts ``pagedllm serve`` with a local stand-in model: nothing is fetched from the hub).
Writes ``raw.json`` (every test), ``summary.json`` and ``summary.md`` (one row per test file) under ``--out``.
Not part of ``make test``: it downloads, and takes long."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VERSION = "0.34.0"
URL = ("https://files.pythonhosted.org/packages/92/21/6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/"
       f"vllm-{VERSION}.tar.gz")
SHA256 = "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"
#: What is unpacked from the source package (paths under its top folder).
UNPACKED = ("tests/entrypoints/", "tests/tool_use/", "tests/__init__.py", "examples/")
DEFAULT_PATHS = ["tests/entrypoints", "tests/tool_use"]
PYTEST_INI = """[pytest]
# written by pagedllm's benchmarks/vllm_server_tests.py (vLLM's own tests/conftest.py is not used)
asyncio_default_fixture_loop_scope = function
filterwarnings =
    ignore::pytest.PytestUnknownMarkWarning
"""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(cache: Path, local: Path | None = None) -> Path:
    """The source package in the cache, downloaded (or copied from ``local``) if it is not there yet; its hash is
    checked before it gets its final name."""
    target = cache / f"vllm-{VERSION}.tar.gz"
    if target.exists() and _sha256(target) == SHA256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    part = cache / f".vllm-{VERSION}.tar.gz.{os.getpid()}.part"
    try:
        if local is not None:
            shutil.copyfile(local, part)
        else:
            print(f"downloading {URL}", flush=True)
            with urllib.request.urlopen(URL, timeout=60) as r, open(part, "wb") as f:
                shutil.copyfileobj(r, f, 1 << 20)
        got = _sha256(part)
        if got != SHA256:
            raise SystemExit(f"sha256 of the downloaded vllm-{VERSION}.tar.gz is {got}, expected {SHA256}")
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    return target


def unpack(sdist: Path, cache: Path) -> Path:
    """The test folders (UNPACKED) of the source package under ``cache/vllm-VERSION-tests``, unpacked aside then
    renamed into place; our pytest.ini beside them."""
    dest = cache / f"vllm-{VERSION}-tests"
    if (dest / "pytest.ini").exists():
        return dest
    aside = cache / f".vllm-{VERSION}-tests.{os.getpid()}"
    shutil.rmtree(aside, ignore_errors=True)
    top = f"vllm-{VERSION}/"
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name[len(top):] if m.name.startswith(top) else ""
            if rel and any(rel.startswith(p) for p in UNPACKED) and (m.isfile() or m.isdir()):
                m.name = rel
                members.append(m)
        tar.extractall(aside, members=members, filter="data")
    (aside / "pytest.ini").write_text(PYTEST_INI)
    try:
        os.rename(aside, dest)
    except OSError:  # another run got there first
        shutil.rmtree(aside, ignore_errors=True)
    return dest


def run_tests(root: Path, out: Path, paths: list[str], keyword: str | None, timeout: int,
              extra: list[str]) -> Path:
    """pytest over ``paths`` under the shim; its output goes to out/pytest.log; returns raw.json's path."""
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "raw.json"
    env = dict(os.environ)
    env.update({
        # vllm_shim/launch: a `python -m vllm.entrypoints.openai.api_server` a test starts itself runs pagedllm
        # serve (in the test process the stand-in vllm of fake_vllm.py comes first)
        "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE / "vllm_shim" / "launch"),
                                       env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "VLLM_SHIM_ROOT": str(root), "VLLM_SHIM_OUT": str(raw), "VLLM_SHIM_LOGS": str(out / "servers"),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    })
    cmd = [sys.executable, "-m", "pytest", "-p", "vllm_shim.plugin", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "-q", "-rN", "--timeout", str(timeout), *paths, *extra]
    if keyword:
        cmd += ["-k", keyword]
    print(" ".join(cmd), flush=True)
    started = time.time()
    with open(out / "pytest.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            sys.stdout.write(line)
        proc.wait()
    print(f"pytest exited with {proc.returncode} after {time.time() - started:.0f} s", flush=True)
    if not raw.exists():
        raise SystemExit(f"pytest wrote no results (see {out / 'pytest.log'})")
    return raw


# ---------------------------------------------------------------------------------------------------------------
# The summary

#: A failure whose error says a field, route or value is not there: a feature we lack.
MISSING = re.compile(r"NotFoundError|Error code: 404|404 Not Found|not supported|Extra inputs|extra_forbidden|"
                     r"unknown field|Unrecognized|is not allowed|not implemented|Method Not Allowed|Error code: 405|"
                     r"Not Found|\b404\b",
                     re.I)


def _message(reason: str) -> str:
    """The gist of a failure: an API error's message when there is one; numbers and ids blanked."""
    m = re.search(r"'message': ['\"](.*?)['\"], '", reason)
    text = m.group(1) if m else reason
    text = re.sub(r"0x[0-9a-f]+|\b[0-9a-f]{16,}\b", "#", text)
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    return text[:160]


def classify(test: dict[str, Any]) -> str:
    """One of: internal (used vLLM's own code), passed, missing, differs, timeout, skip-flag, skip-model,
    skip-test, skip-shim, no-server (ran without sending a request to a server)."""
    outcome, reason = test["outcome"], test["reason"]
    if outcome == "internal":
        return "internal"
    if outcome == "skipped":
        for tag, kind in (("[flag]", "skip-flag"), ("[env]", "skip-flag"), ("[start]", "skip-flag"),
                          ("[model]", "skip-model"), ("[hub]", "skip-model"), ("[gpu]", "skip-model"),
                          ("[shim]", "skip-shim")):
            if reason.startswith(tag):
                return kind
        return "skip-test"
    if not test["reached"]:
        return "no-server"
    if outcome == "passed":
        return "passed"
    if "Timeout" in reason:
        return "timeout"
    return "missing" if MISSING.search(reason) else "differs"


COLUMNS = [("tests", "tests"), ("internal", "uses vLLM internals"), ("reached", "reached server"), ("passed", "passed"),
           ("missing", "failed: missing feature"), ("differs", "failed: differing behaviour"),
           ("timeout", "timed out"), ("skip-flag", "skipped: flag we lack"),
           ("skip-model", "skipped: model-specific"), ("skip-test", "skipped by the test"),
           ("skip-shim", "skipped: shim"), ("no-server", "ran, no server")]


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Per test file: the counts of COLUMNS; files that did not import and why; failure and skip reasons grouped."""
    files: dict[str, Counter] = defaultdict(Counter)
    reasons: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for test in raw["tests"]:
        kind = classify(test)
        row = files[test["file"]]
        row["tests"] += 1
        row[kind] += 1
        if test["reached"]:
            row["reached"] += 1
        if kind == "internal":
            m = re.search(r"uses (vllm(?:\.\w+){0,2})", test["reason"])
            reasons[kind][f"uses {m.group(1) if m else test['reason'][:100]}"].append(test["nodeid"])
        elif kind != "passed":
            key = _message(test["reason"]) if kind in ("missing", "differs", "timeout") else test["reason"][:200]
            reasons[kind][key].append(test["nodeid"])
    not_imported = {}
    for err in raw["collect_errors"]:
        m = re.search(r"No module named '([^']+)'|cannot import name '(\w+)' from '([\w.]+)'", err["reason"])
        if m and m.group(1):
            why = f"imports {m.group(1)}"
        elif m:
            why = f"imports {m.group(3)}.{m.group(2)}"
        else:
            why = err["reason"][:200]
        not_imported[err["file"]] = why
    totals: Counter = Counter()
    for row in files.values():
        totals.update(row)
    return {"files": {f: dict(r) for f, r in sorted(files.items())}, "totals": dict(totals),
            "not_imported": dict(sorted(not_imported.items())),
            "reasons": {k: {r: sorted(v) for r, v in sorted(g.items(), key=lambda x: -len(x[1]))}
                        for k, g in reasons.items()},
            "server_starts": raw.get("server_starts", [])}


def _short_id(nodeid: str) -> str:
    """`file.py::test[param]` without the folders, bounded."""
    name = nodeid.split("::")[0].rsplit("/", 1)[-1] + "::" + nodeid.split("::", 1)[-1]
    return name if len(name) <= 70 else name[:67] + "..."


def markdown(summary: dict[str, Any], title: str) -> str:
    """The summary as Markdown: the per-file table, then the grouped reasons."""
    lines = [f"# {title}", "", "| test file | " + " | ".join(name for _, name in COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 1) + "|"]
    for f, row in summary["files"].items():
        lines.append(f"| `{f}` | " + " | ".join(str(row.get(k, 0)) for k, _ in COLUMNS) + " |")
    t = summary["totals"]
    lines.append("| **total** | " + " | ".join(f"**{t.get(k, 0)}**" for k, _ in COLUMNS) + " |")
    lines += ["", f"Files not collected (they import vLLM's own code or test helpers, so never reach a server): "
              f"{len(summary['not_imported'])}.", ""]
    by_why = Counter(re.sub(r"\.\w+$", "", w) if w.startswith("imports vllm") else w
                     for w in summary["not_imported"].values())
    for why, n in by_why.most_common(30):
        lines.append(f"- {n} × {why}")
    names = dict(COLUMNS)
    for kind in ("missing", "differs", "timeout", "skip-flag", "skip-model", "skip-shim", "skip-test", "no-server",
                 "internal"):
        groups = summary["reasons"].get(kind)
        if not groups:
            continue
        lines += ["", f"## {names[kind]}", ""]
        for reason, tests in list(groups.items())[:40]:
            shown = ", ".join(f"`{_short_id(t)}`" for t in tests[:3])
            more = f" (+{len(tests) - 3})" if len(tests) > 3 else ""
            lines.append(f"- **{len(tests)}** — {reason.replace('|', '/')} — {shown}{more}")
    return "\n".join(lines) + "\n"


def merge(raw_paths: list[Path]) -> dict[str, Any]:
    """Several runs' raw.json as one: a test file found in a later run replaces its results from earlier ones
    (a rerun of some files after a change)."""
    merged: dict[str, Any] = {"tests": [], "collect_errors": [], "collected": {}, "server_starts": []}
    for path in raw_paths:
        raw = json.loads(path.read_text())
        files = {t["file"] for t in raw["tests"]} | {e["file"] for e in raw["collect_errors"]}
        for key in ("tests", "collect_errors", "server_starts"):
            merged[key] = [x for x in merged[key] if x["file"] not in files] + raw.get(key, [])
        merged["collected"].update(raw.get("collected", {}))
    return merged


def write_summary(raw_paths: list[Path], out: Path) -> dict[str, Any]:
    """summary.json and summary.md (of one run's raw.json, or of several merged) under ``out``."""
    summary = summarize(merge(raw_paths))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    summary["commit"] = commit
    summary["written"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    title = f"vLLM {VERSION}'s server tests against pagedllm serve ({commit}, {summary['written']})"
    (out / "summary.md").write_text(markdown(summary, title))
    return summary


def main() -> None:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("-k", dest="keyword", help="pytest's -k expression, passed on")
    parser.add_argument("--paths", nargs="+", default=DEFAULT_PATHS,
                        help="test folders or files, relative to the source package (default: %(default)s)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per test, server start included")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "pagedllm-bench" / "vllm-tests",
                        help="where the source package and its unpacked tests are kept")
    parser.add_argument("--sdist", type=Path, help="a local copy of the source package (checked against the hash)")
    parser.add_argument("--out", type=Path, default=Path("out") / "vllm_server_tests", help="results folder")
    parser.add_argument("--summarize", type=Path, nargs="+", metavar="RAW_JSON",
                        help="only write the summary of a run's raw.json (of several: a file's results in a later "
                        "one replace its results in the earlier ones)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    if args.summarize:
        summary = write_summary(args.summarize, args.out)
    else:
        root = unpack(fetch_sdist(args.cache, args.sdist), args.cache)
        raw = run_tests(root, args.out.resolve(), args.paths, args.keyword, args.timeout, args.pytest_args)
        summary = write_summary([raw], args.out)
    print(json.dumps(summary["totals"]))
    print(f"summary: {args.out / 'summary.md'}")


if __name__ == "__main__":
    main()
