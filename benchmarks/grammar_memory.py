"""The engine core's RSS while distinct large JSON schemas arrive (issue 43, point 2): the grammar cache must bound
what compiled grammars hold, as measured, not xgrammar's estimate.

Serves the tiny test model (the default model's tokenizer: what the grammars are compiled against) with a small
grammar cache, sends --count distinct ~55 KB schemas of 1,400 properties as `response_format`, one at a time, and
prints the core's RSS every 50; the last JSON line has the growth against the bound (cache + 300 MB).

    .venv/bin/python benchmarks/grammar_memory.py --count 500
    .venv/bin/python benchmarks/grammar_memory.py --count 500 --server-args "--grammar-cache-memory 256MiB"
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.config import parse_memory  # noqa: E402
from pagedllm.models.loader import default_model_path, load_tokenizer  # noqa: E402
from tests.entrypoints.openai.test_abuse_structured import _core, _schema_format, _wide_schema  # noqa: E402
from tests.utils import RemoteServer, save_tiny_model  # noqa: E402

MIB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=500, help="distinct schemas to send")
    parser.add_argument("--cache", default="64MiB", help="--grammar-cache-memory of the server")
    parser.add_argument("--server-args", default="--max-grammar-memory 32MiB", help="more `pagedllm serve` flags")
    args = parser.parse_args()
    tokenizer = load_tokenizer(default_model_path())
    with tempfile.TemporaryDirectory() as folder:
        model = save_tiny_model(Path(folder), "llama-gqa-untied", vocab_size=len(tokenizer), tokenizer=tokenizer)
        srv = RemoteServer(model, "--served-model-name", "tiny", "--num-kv-blocks", "200", "--max-model-len", "256",
                           "--grammar-cache-memory", args.cache, *shlex.split(args.server_args))
        try:
            core = _core(srv)
            url = f"{srv.url}/v1/completions"
            body = {"prompt": "hi", "max_tokens": 1, "structured_outputs": {"regex": "[a-z]+"}}
            assert httpx.post(url, json=body, timeout=60).status_code == 200  # the compiler exists
            before, peak, start = core.memory_info().rss, 0, time.monotonic()
            for k in range(args.count):
                body = {"prompt": "hi", "max_tokens": 1, "response_format": _schema_format(_wide_schema(k))}
                r = httpx.post(url, json=body, timeout=300)
                assert r.status_code == 200, r.text
                peak = max(peak, core.memory_info().rss)
                if (k + 1) % 50 == 0:
                    rss = core.memory_info().rss
                    print(f"{k + 1} schemas: core RSS {rss / MIB:.0f} MiB ({(rss - before) / MIB:+.0f}), "
                          f"{time.monotonic() - start:.0f} s", flush=True)
            bound = parse_memory(args.cache, "cache") + 300 * MIB
            print(json.dumps({"schemas": args.count, "core_rss_before_mib": round(before / MIB),
                              "core_rss_peak_mib": round(peak / MIB), "growth_mib": round((peak - before) / MIB),
                              "bound_mib": round(bound / MIB), "within_bound": peak - before < bound,
                              "seconds": round(time.monotonic() - start, 1)}))
            return 0 if peak - before < bound else 1
        finally:
            srv.stop()


if __name__ == "__main__":
    sys.exit(main())
