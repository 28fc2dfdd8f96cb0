"""Speculative decoding on the default model: no speculation vs prompt lookup (ngram) vs suffix decoding.

One run, one LLM per configuration (all created first), the configurations alternating round by
round (for round in rounds: for config in configs: run the workload), so that this machine's speed
drifts alike for all of them:

    .venv/bin/python benchmarks/spec_decode.py                        # 3 rounds, everything
    .venv/bin/python benchmarks/spec_decode.py --configs none,ngram,suffix,suffix-nocache \
        --llamacpp-python ~/.cache/pagedllm-peers/llama-cpp/bin/python --output-json spec_decode.json
    .venv/bin/python benchmarks/spec_decode.py --rounds 5 --workloads grounded,free
    .venv/bin/python benchmarks/spec_decode.py --rounds 1 --max-tokens 32 --batch-num-prompts 16  # smoke test
    .venv/bin/python benchmarks/spec_decode.py --export-prompts prompts.json --workloads none  # prompts only

Workloads (--workloads):
  grounded  single stream, greedy, chat template applied: edit / rename / document a piece of code
            and summarise a passage quoting it (tests/data/prose.txt), i.e. outputs that copy the
            prompt, where drafts from the context are accepted. --max-tokens each, EOS honoured.
  free      single stream, greedy, chat template: a story and a list, nothing to copy from.
  batched   --batch-num-prompts requests of --batch-input-len random token ids, --batch-output-len
            tokens each, temperature 1.0, top_p 1.0, ignore_eos: `pagedllm bench throughput`'s random
            workload (prompts from pagedllm.entrypoints.bench.datasets.random_requests, seed
            --seed + round, so no round reuses another's prompts), all in one LLM.generate call.

Configurations (--configs): none (no speculation), ngram ({"method": "ngram",
"num_speculative_tokens": --num-speculative-tokens, "prompt_lookup_min": --prompt-lookup-min,
"prompt_lookup_max": --prompt-lookup-max}), suffix ({"method": "suffix"}), and, only when asked for,
suffix-nocache ({"method": "suffix", "suffix_decoding_max_cached_requests": 0}: drafts from the
request's own tokens only). Note that suffix decoding keeps earlier responses: from round 2 on it has
seen the very response of each single-stream prompt, so its later rounds (see "per round") show a
repeated-request workload; suffix-nocache and round 1 do not.

Measures, per workload and configuration:
  tok/s     single stream: output tokens / wall time of the LLM.generate calls, summed over the
            workload's prompts, one generate call per prompt (prompt prefill and detokenization
            included, nothing subtracted; prefix caching is off unless --enable-prefix-caching, so
            every call prefills its prompt). batched: total (prompt + output) tokens / wall time of
            the one generate call, as `pagedllm bench throughput`; its output tokens/s in the JSON.
  median    of the per-round figures; speedup = median / median of `none`.
  acceptance  accepted / draft tokens, from llm.get_stats() deltas over all rounds
            (spec_decode_num_accepted_tokens / spec_decode_num_draft_tokens), and the mean
            acceptance length 1 + accepted / drafts (tokens per verifying forward).
  ceiling   single stream: output tokens / forward passes that emitted them (output tokens - accepted
            drafts: a plain step emits one, a verifying step 1 + its accepted drafts), over all rounds:
            the speedup these very drafts would give if a verifying forward cost no more than a plain
            one, prefill and detokenization free. No kernel makes a configuration faster than this.
  identical  greedy workloads: whether every prompt's output token ids equal those of `none` in the
            same round (and `none`'s own rounds agree); each difference prints a MISMATCH line with
            the first differing position.

--llamacpp-python PATH then runs benchmarks/spec_decode_llamacpp.py with that interpreter (the
llama-cpp peer's venv, see ../shared/peers/README.md) on the same GGUF file and the same
chat-templated token ids (grounded and free), with and without llama-cpp-python's
LlamaPromptLookupDecoding, after pagedllm's engines are shut down, and prints its table too (if
it dies of a signal, as ggml's AMX buffers do on some CPUs, once more with --extra-bufts 0).

Prints a markdown table, then one JSON line (also written to --output-json). Exit status 1 when a
greedy output differed from `none` (the MISMATCH lines), else 0.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROSE = os.path.join(ROOT, "tests", "data", "prose.txt")
LLAMACPP_SCRIPT = os.path.join(ROOT, "benchmarks", "spec_decode_llamacpp.py")
SPEC_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
CONFIG_NAMES = ("none", "ngram", "suffix", "suffix-nocache")
WORKLOADS = ("grounded", "free", "batched")

# ------------------------------------------------------------------------------------------ prompts
BUGGY_FUNCTION = '''\
def merge_intervals(intervals, min_gap=0):
    """Merge overlapping [start, end] intervals.

    Two intervals are merged when the gap between them is at most min_gap.
    Returns a new list of intervals sorted by start.
    """
    if not intervals:
        return []
    for start, end in intervals:
        if start > end:
            raise ValueError(f"bad interval: {start} > {end}")
    ordered = sorted(intervals, key=lambda pair: pair[1])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        gap = start - last[1]
        if gap <= min_gap:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    result = []
    for start, end in merged:
        result.append((start, end))
    return result


def total_length(intervals):
    """Total length covered by the intervals, overlaps counted once."""
    length = 0
    for start, end in merge_intervals(intervals):
        length += end - start
    return length


def covers(intervals, point):
    """Whether any interval contains the point (ends included)."""
    for start, end in merge_intervals(intervals):
        if start <= point <= end:
            return True
    return False
'''

RENAME_CODE = '''\
def invoice_summary(items, tax_rate, discount=None):
    total = 0
    lines = []
    for name, quantity, price in items:
        cost = quantity * price
        total += cost
        lines.append(f"{name:<20} {quantity:>4} x {price:>8.2f} = {cost:>10.2f}")
    if discount is not None:
        lines.append(f"{'discount':<20} {-discount:>26.2f}")
        total -= discount
    if total < 0:
        total = 0
    tax = total * tax_rate
    lines.append(f"{'tax':<20} {tax:>26.2f}")
    total += tax
    lines.append(f"{'total':<20} {total:>26.2f}")
    return total, "\\n".join(lines)


def average_invoice(invoices, tax_rate):
    total = 0
    for items in invoices:
        amount, _ = invoice_summary(items, tax_rate)
        total += amount
    return total / len(invoices) if invoices else 0.0
'''

DOCSTRING_CODE = '''\
class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}
        self.order = []

    def get(self, key, default=None):
        if key not in self.items:
            return default
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
        self.items[key] = value
        self.order.append(key)

    def __len__(self):
        return len(self.items)

    def clear(self):
        self.items.clear()
        self.order.clear()
'''

WARMUP_MESSAGE = """Return this code unchanged:

```python
def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value


def normalize(values):
    largest = max(abs(v) for v in values) or 1.0
    return [clamp(v / largest, -1.0, 1.0) for v in values]
```"""

FALLBACK_PASSAGE = """\
The lighthouse at the end of the harbour was built in 1852 from granite quarried on the island \
itself. For more than a century its lamp was kept by a single family, who trimmed the wicks, wound \
the clockwork that turned the lens, and wrote the weather into a log every four hours. The log \
survives: it records storms that lasted a week, ships that passed without lights, and one winter \
when the harbour froze so hard that the keeper walked to the mainland and back. In 1961 the lamp \
was electrified and the clockwork replaced by a motor; in 1987 the last keeper left, and the light \
has been run from the mainland ever since. The building is now a museum. Its lens, made of more \
than three hundred pieces of glass, still turns every night, and on clear evenings it can be seen \
from thirty kilometres away. Visitors climb the hundred and twelve steps to the lantern room, read \
the old log in the keeper's cottage, and look at the photographs of the family who lived there. \
The museum's guides say that the most common question is not about the light at all, but about \
the keepers: how they lived so far from other people, what they ate when the boats could not come, \
and whether they were lonely. The log answers some of these questions. It lists the supplies that \
arrived each month, the visitors who came in summer, and the births of three children in the \
cottage. It does not say whether anyone was lonely."""


def summary_passage(max_words: int = 300) -> str:
    """About max_words words of prose from tests/data/prose.txt (whole paragraphs from the Gettysburg
    Address on), else a passage of our own."""
    try:
        with open(PROSE, encoding="utf-8") as f:
            paragraphs = [p.strip() for p in f.read().split("\n\n") if p.strip()]
    except OSError:
        return FALLBACK_PASSAGE
    start = next((i for i, p in enumerate(paragraphs) if p.startswith("Four score")), None)
    if start is None:
        return FALLBACK_PASSAGE
    chosen: list[str] = []
    for p in paragraphs[start:]:
        if chosen and sum(len(c.split()) for c in chosen) + len(p.split()) > max_words:
            break
        chosen.append(p)
    return "\n\n".join(chosen)


def workload_messages() -> dict[str, list[tuple[str, str]]]:
    """(name, user message) of each single-stream workload."""
    return {
        "grounded": [
            ("fix-bug", "Fix the bug in this Python code (the intervals are sorted by the wrong key) and return "
                        "the whole corrected code:\n\n```python\n" + BUGGY_FUNCTION + "```"),
            ("rename", "Rename the variable `total` to `running_sum` in this code and return all of it:\n\n"
                       "```python\n" + RENAME_CODE + "```"),
            ("docstrings", "Add a one-line docstring to every method of this class and return the whole class:"
                           "\n\n```python\n" + DOCSTRING_CODE + "```"),
            ("summarize", "Summarize this passage, quoting its key sentences verbatim:\n\n" + summary_passage()),
        ],
        "free": [
            ("story", "Write a short story about a lighthouse keeper."),
            ("party-ideas", "List ten ideas for a birthday party."),
        ],
    }


# ---------------------------------------------------------------------------------------- configs
def speculative_config(name: str, ns: argparse.Namespace) -> dict[str, Any] | None:
    if name == "none":
        return None
    if name == "ngram":
        return {"method": "ngram", "num_speculative_tokens": ns.num_speculative_tokens,
                "prompt_lookup_min": ns.prompt_lookup_min, "prompt_lookup_max": ns.prompt_lookup_max}
    if name == "suffix":
        return {"method": "suffix"}
    if name == "suffix-nocache":
        return {"method": "suffix", "suffix_decoding_max_cached_requests": 0}
    raise ValueError(f"unknown configuration {name!r}; known: {', '.join(CONFIG_NAMES)}")


def csv_choice(known: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(known)}")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"repeated names in {text!r}")
        return items
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every workload on every config")
    ap.add_argument("--configs", type=csv_choice(CONFIG_NAMES), default=["none", "ngram", "suffix"],
                    help=f"comma-separated, from {', '.join(CONFIG_NAMES)} (default: none,ngram,suffix)")
    ap.add_argument("--workloads", type=lambda s: [] if s == "none" else csv_choice(WORKLOADS)(s),
                    default=list(WORKLOADS), help="comma-separated, from grounded,free,batched, or none "
                                                  "(default: all)")
    ap.add_argument("--max-tokens", type=int, default=384, help="max_tokens of single-stream prompts (384)")
    ap.add_argument("--num-speculative-tokens", type=int, default=5, help="ngram: draft tokens per step (5)")
    ap.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: shortest suffix looked up (2)")
    ap.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest suffix looked up (4)")
    ap.add_argument("--batch-num-prompts", type=int, default=256, help="batched: requests (256)")
    ap.add_argument("--batch-input-len", type=int, default=128, help="batched: prompt tokens (128)")
    ap.add_argument("--batch-output-len", type=int, default=128, help="batched: output tokens (128)")
    ap.add_argument("--seed", type=int, default=0, help="engine seed; batched prompts use seed + round")
    ap.add_argument("--model", default=None, help="model (default: the default model, SmolLM2-135M Q4_1 GGUF)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-memory", default="2GiB", help="KV pool of each LLM (2GiB: three fit in memory)")
    ap.add_argument("--enable-prefix-caching", action="store_true",
                    help="keep prefix caching on (default off: every call prefills its prompt)")
    ap.add_argument("--warmup-tokens", type=int, default=32,
                    help="each LLM first generates this many tokens untimed, for a prompt of its own "
                         "(0: no warm-up)")
    ap.add_argument("--export-prompts", default=None,
                    help="write the chat-templated single-stream prompts (text and token ids) to this JSON file")
    ap.add_argument("--llamacpp-python", default=None,
                    help="the llama-cpp peer's python: also run benchmarks/spec_decode_llamacpp.py with it")
    ap.add_argument("--llamacpp-num-pred-tokens", default="2,10",
                    help="LlamaPromptLookupDecoding num_pred_tokens values, comma-separated (2,10: its "
                         "docs' CPU advice and its default)")
    ap.add_argument("--llamacpp-max-ngram-size", type=int, default=2,
                    help="LlamaPromptLookupDecoding max_ngram_size (its default 2)")
    ap.add_argument("--llamacpp-rounds", type=int, default=None, help="llama.cpp rounds (default: --rounds)")
    ap.add_argument("--llamacpp-extra-args", default="",
                    help="more flags for spec_decode_llamacpp.py, e.g. '--extra-bufts 0'")
    ap.add_argument("--output-json", default=None, help="also write the JSON line to this file")
    ns = ap.parse_args(argv)
    for flag in ("rounds", "max_tokens", "batch_num_prompts", "batch_input_len", "batch_output_len"):
        if getattr(ns, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if not ns.configs:
        ap.error("--configs names no configuration")
    return ns


# ------------------------------------------------------------------------------------------ running
def spec_counts(llm: Any) -> dict[str, int]:
    stats = vars(llm.get_stats())
    return {k: int(stats.get(k, 0)) for k in SPEC_KEYS}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in SPEC_KEYS}


def run_single(llm: Any, prompts: list[dict], max_tokens: int) -> dict[str, Any]:
    """Each prompt alone, greedy: its output ids, tokens, seconds and spec counters."""
    from pagedllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False)
    per_prompt = []
    for p in prompts:
        before = spec_counts(llm)
        start = time.perf_counter()
        out = llm.generate({"prompt_token_ids": p["ids"]}, params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        ids = list(out.outputs[0].token_ids)
        per_prompt.append({"name": p["name"], "ids": ids, "tokens": len(ids), "seconds": seconds,
                           "finish_reason": out.outputs[0].finish_reason,
                           "spec": delta(spec_counts(llm), before)})
    tokens = sum(r["tokens"] for r in per_prompt)
    seconds = sum(r["seconds"] for r in per_prompt)
    return {"tok_s": tokens / seconds, "output_tokens": tokens, "seconds": seconds, "per_prompt": per_prompt,
            "spec": {k: sum(r["spec"][k] for r in per_prompt) for k in SPEC_KEYS}}


def run_batched(llm: Any, ns: argparse.Namespace, round_index: int) -> dict[str, Any]:
    from pagedllm.entrypoints.bench.datasets import random_requests
    from pagedllm.sampling_params import SamplingParams

    vocab = llm.llm_engine.processor.vocab_size
    requests = random_requests(ns.batch_num_prompts, ns.batch_input_len, ns.batch_output_len, vocab,
                               ns.seed + round_index)
    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.output_len)
              for r in requests]
    before = spec_counts(llm)
    start = time.perf_counter()
    outs = llm.generate([r.as_prompt() for r in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(r.prompt_len for r in requests)
    return {"tok_s": (in_tokens + out_tokens) / seconds, "output_tok_s": out_tokens / seconds,
            "input_tokens": in_tokens, "output_tokens": out_tokens, "seconds": seconds,
            "spec": delta(spec_counts(llm), before)}


def acceptance(spec: dict[str, int]) -> dict[str, Any] | None:
    drafts, draft_tokens, accepted = (spec[k] for k in SPEC_KEYS)
    if not draft_tokens:
        return None
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens, "mean_acceptance_length": 1 + accepted / drafts}


def ceiling(tokens: int, spec: dict[str, int]) -> float | None:
    """Output tokens per forward that emitted them: the speedup if verifying cost what a plain step does."""
    accepted = spec[SPEC_KEYS[2]]
    return tokens / (tokens - accepted) if accepted and tokens > accepted else None


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_identical(results: dict, workload: str, configs: list[str], rounds: int, tokenizer: Any) -> dict[str, bool]:
    """config -> whether every prompt's greedy ids equal `none`'s of the same round; prints MISMATCH lines."""
    if "none" not in configs:
        return {}
    verdict = {}
    ref_rounds = results[workload]["none"]
    for r in range(1, rounds):  # none against itself
        for p0, p in zip(ref_rounds[0]["per_prompt"], ref_rounds[r]["per_prompt"]):
            if p0["ids"] != p["ids"]:
                i = first_difference(p0["ids"], p["ids"])
                print(f"MISMATCH {workload}/{p['name']}: config none round {r + 1} differs from none round 1 "
                      f"at output token {i} (lengths {len(p0['ids'])} / {len(p['ids'])})")
    for name in configs:
        if name == "none":
            continue
        ok = True
        for r in range(rounds):
            for ref, got in zip(ref_rounds[r]["per_prompt"], results[workload][name][r]["per_prompt"]):
                if ref["ids"] == got["ids"]:
                    continue
                ok = False
                i = first_difference(ref["ids"], got["ids"])
                context = tokenizer.decode(ref["ids"][max(0, i - 8):i]) if i else ""
                print(f"MISMATCH {workload}/{got['name']}: config {name} round {r + 1} differs from none at "
                      f"output token {i} (lengths {len(ref['ids'])} / {len(got['ids'])}; "
                      f"none: {ref['ids'][i:i + 4]} {tokenizer.decode(ref['ids'][i:i + 4])!r}, "
                      f"{name}: {got['ids'][i:i + 4]} {tokenizer.decode(got['ids'][i:i + 4])!r}, "
                      f"after {context!r})")
        verdict[name] = ok
    return verdict


def run_llamacpp(ns: argparse.Namespace, prompts_file: str, gguf: str) -> dict[str, Any] | None:
    cmd = [ns.llamacpp_python, LLAMACPP_SCRIPT, "--gguf", gguf, "--prompts", prompts_file,
           "--rounds", str(ns.llamacpp_rounds or ns.rounds), "--max-tokens", str(ns.max_tokens),
           "--num-pred-tokens", ns.llamacpp_num_pred_tokens, "--max-ngram-size", str(ns.llamacpp_max_ngram_size),
           *ns.llamacpp_extra_args.split()]
    print("\n$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode < 0 and "--extra-bufts" not in cmd:
        # ggml's AMX / repacking buffers crash on some CPUs (../shared/peers/README.md): once more without
        print(f"llama.cpp died with signal {-proc.returncode}; again with --extra-bufts 0", flush=True)
        cmd += ["--extra-bufts", "0"]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
        else:
            print(line)
    if proc.returncode != 0 or result is None:
        print(f"llama.cpp run failed (exit status {proc.returncode})")
    return result


# ----------------------------------------------------------------------------------------- reporting
def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def prompt_summary(rounds: list[dict[str, Any]], i: int) -> dict[str, Any]:
    """Prompt i of a single-stream workload over every round of one configuration."""
    runs = [r["per_prompt"][i] for r in rounds]
    spec = {k: sum(run["spec"][k] for run in runs) for k in SPEC_KEYS}
    return {"tok_s_median": statistics.median(run["tokens"] / run["seconds"] for run in runs),
            "output_tokens": runs[0]["tokens"], "finish_reason": runs[0]["finish_reason"],
            "acceptance": acceptance(spec), "ceiling": ceiling(sum(run["tokens"] for run in runs), spec)}


def summarize(results: dict, configs: list[str], workloads: list[str],
              identical: dict[str, dict[str, bool]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for w in workloads:
        summary[w] = {}
        base = statistics.median(r["tok_s"] for r in results[w]["none"]) if "none" in configs else None
        for c in configs:
            per_round = [r["tok_s"] for r in results[w][c]]
            med = statistics.median(per_round)
            spec = {k: sum(r["spec"][k] for r in results[w][c]) for k in SPEC_KEYS}
            entry = {"tok_s_per_round": per_round, "tok_s_median": med,
                     "speedup_vs_none": med / base if base else None,
                     "acceptance": acceptance(spec),
                     "acceptance_per_round": [acceptance(r["spec"]) for r in results[w][c]],
                     "identical_to_none": identical.get(w, {}).get(c)}
            if w == "batched":
                entry["output_tok_s_per_round"] = [r["output_tok_s"] for r in results[w][c]]
            else:
                entry["output_tokens_per_round"] = [r["output_tokens"] for r in results[w][c]]
                entry["ceiling"] = ceiling(sum(entry["output_tokens_per_round"]), spec)
                entry["per_prompt"] = {p["name"]: prompt_summary(results[w][c], i)
                                       for i, p in enumerate(results[w][c][0]["per_prompt"])}
            summary[w][c] = entry
    return summary


def print_tables(summary: dict[str, Any], configs: list[str], workloads: list[str]) -> None:
    print("\n| workload | config | tok/s median | per round | speedup vs none | acceptance | mean accept len "
          "| ceiling | identical to none |")
    print("|---|---|---:|---|---:|---:|---:|---:|---|")
    for w in workloads:
        for c in configs:
            e = summary[w][c]
            acc = e["acceptance"]
            ident = e["identical_to_none"]
            ident_s = "-" if w == "batched" or c == "none" or ident is None else ("yes" if ident else "NO")
            print(f"| {w} | {c} | {e['tok_s_median']:.1f} | {' / '.join(f'{x:.1f}' for x in e['tok_s_per_round'])} "
                  f"| {fmt(e['speedup_vs_none'], '.2f')} | {fmt(acc and acc['acceptance_rate'], '.3f')} "
                  f"| {fmt(acc and acc['mean_acceptance_length'], '.2f')} | {fmt(e.get('ceiling'), '.2f')} "
                  f"| {ident_s} |")
    single = [w for w in workloads if w != "batched"]
    if single:
        print("\nPer prompt (median tok/s over rounds; acceptance and ceiling over rounds; output tokens of "
              "round 1):\n")
        print("| workload | prompt | " + " | ".join(f"{c} tok/s | {c} acc | {c} ceil" for c in configs)
              + " | tokens |")
        print("|---|---|" + "---:|---:|---:|" * len(configs) + "---:|")
        for w in single:
            for name in summary[w][configs[0]]["per_prompt"]:
                cells = []
                for c in configs:
                    p = summary[w][c]["per_prompt"][name]
                    cells += [f"{p['tok_s_median']:.1f}", fmt(p["acceptance"] and p["acceptance"]["acceptance_rate"],
                                                               ".2f"), fmt(p["ceiling"], ".2f")]
                ref = summary[w][configs[0]]["per_prompt"][name]
                tokens = f"{ref['output_tokens']} ({ref['finish_reason']})"
                print(f"| {w} | {name} | " + " | ".join(cells) + f" | {tokens} |")
    print("\ntok/s: single stream = output tokens / wall time of LLM.generate (one call per prompt, prefill and "
          "detokenization included, nothing subtracted); batched = (prompt + output tokens) / wall time. "
          "ceiling: output tokens / forwards that emitted them, the speedup if verifying were free.")


def print_llamacpp(result: dict[str, Any], pagedllm_none: dict[str, list[list[int]]] | None) -> None:
    print("\nllama.cpp (llama-cpp-python " + str(result.get("llama_cpp_python")) + f", {result.get('threads')} threads"
          "; tok/s = output tokens / wall time of generation, prompt eval included):\n")
    print("| workload | config | tok/s median | per round | speedup vs none | identical to none "
          "| same ids as pagedllm none |")
    print("|---|---|---:|---|---:|---|---|")
    for w, by_config in result["workloads"].items():
        for c, e in by_config.items():
            same = "-"
            if pagedllm_none is not None and w in pagedllm_none:
                prefixes = [first_difference(a, b) for a, b in zip(e["output_ids"], pagedllm_none[w])]
                full = [a == b for a, b in zip(e["output_ids"], pagedllm_none[w])]
                same = f"{sum(full)}/{len(full)} (first diff at {prefixes})"
            ident = e.get("identical_to_none")
            print(f"| {w} | {c} | {e['tok_s_median']:.1f} | {' / '.join(f'{x:.1f}' for x in e['tok_s_per_round'])} "
                  f"| {fmt(e.get('speedup_vs_none'), '.2f')} | {'-' if ident is None else ('yes' if ident else 'NO')} "
                  f"| {same} |")


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    from pagedllm.engine.processor import render_chat
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.models.loader import resolve_model_path

    gguf = resolve_model_path(ns.model)
    engine_kwargs = dict(model=ns.model, dtype=ns.dtype, kv_cache_memory=ns.kv_cache_memory, seed=ns.seed,
                         enable_prefix_caching=ns.enable_prefix_caching)
    llms: dict[str, Any] = {}
    t0 = time.perf_counter()
    # every LLM first, so the rounds below only alternate (no workload: one, for its tokenizer)
    for name in ns.configs if ns.workloads else ns.configs[:1]:
        llms[name] = LLM(speculative_config=speculative_config(name, ns), **engine_kwargs)
    print(f"created {len(llms)} LLMs in {time.perf_counter() - t0:.1f} s: {', '.join(llms)} "
          f"(model {gguf})", flush=True)
    tokenizer = llms[ns.configs[0]].get_tokenizer()

    prompts: dict[str, list[dict]] = {}
    for w, items in workload_messages().items():
        prompts[w] = []
        for name, message in items:
            text, ids = render_chat(tokenizer, [{"role": "user", "content": message}], None, True)
            prompts[w].append({"name": name, "text": text, "ids": list(ids)})
    prompts_file = ns.export_prompts
    if prompts_file is None and ns.llamacpp_python:
        prompts_file = os.path.join(tempfile.mkdtemp(prefix="spec_decode_"), "prompts.json")
    if prompts_file:
        with open(prompts_file, "w") as f:
            json.dump({"model": gguf, "max_tokens": ns.max_tokens,
                       "workloads": {w: prompts[w] for w in ("grounded", "free")}}, f)
        print(f"wrote the chat-templated prompts to {prompts_file}")

    if ns.warmup_tokens > 0 and ns.workloads:
        from pagedllm.sampling_params import SamplingParams
        _, warm_ids = render_chat(tokenizer, [{"role": "user", "content": WARMUP_MESSAGE}], None, True)
        for llm in llms.values():  # a long prompt and drafts that get verified, none of the measured prompts
            llm.generate({"prompt_token_ids": list(warm_ids)},
                         SamplingParams(temperature=0.0, max_tokens=ns.warmup_tokens), use_tqdm=False)
            if "batched" in ns.workloads:  # and a small batch (prompts of a seed no round uses)
                from pagedllm.entrypoints.bench.datasets import random_prompts
                llm.generate(random_prompts(8, ns.batch_input_len, llm.llm_engine.processor.vocab_size, 2**31 - 1),
                             SamplingParams(temperature=1.0, ignore_eos=True, max_tokens=ns.warmup_tokens),
                             use_tqdm=False)

    results: dict[str, dict[str, list]] = {w: {c: [] for c in ns.configs} for w in ns.workloads}
    for r in range(ns.rounds):
        for w in ns.workloads:
            for c in ns.configs:
                res = (run_batched(llms[c], ns, r) if w == "batched"
                       else run_single(llms[c], prompts[w], ns.max_tokens))
                results[w][c].append(res)
                acc = acceptance(res["spec"])
                print(f"round {r + 1}/{ns.rounds} {w:<8} {c:<14} {res['tok_s']:8.1f} tok/s  "
                      f"{res['output_tokens']:6d} output tokens in {res['seconds']:6.2f} s"
                      + (f"  acceptance {acc['acceptance_rate']:.3f}" if acc else ""), flush=True)

    identical = {w: check_identical(results, w, ns.configs, ns.rounds, tokenizer)
                 for w in ns.workloads if w != "batched"}
    for llm in llms.values():
        llm.shutdown()
    del llms

    summary = summarize(results, ns.configs, ns.workloads, identical)
    if ns.workloads:
        print_tables(summary, ns.configs, ns.workloads)
        if "suffix" in ns.configs and ns.rounds > 1 and set(ns.workloads) & {"grounded", "free"}:
            print("NOTE: suffix decoding keeps earlier responses, so from round 2 on it has seen each "
                  "single-stream prompt's own response: its round-1 figure is the first-time one (suffix-nocache "
                  "in --configs measures drafts from the request alone in every round).")

    llamacpp = None
    if ns.llamacpp_python:
        llamacpp = run_llamacpp(ns, prompts_file, gguf)
        if llamacpp is not None:
            none_ids = ({w: [p["ids"] for p in results[w]["none"][0]["per_prompt"]]
                         for w in ns.workloads if w != "batched"} if "none" in ns.configs else None)
            print_llamacpp(llamacpp, none_ids)

    out = {"benchmark": "spec_decode", "model": gguf, "rounds": ns.rounds, "configs": {
               c: speculative_config(c, ns) for c in ns.configs},
           "max_tokens": ns.max_tokens, "enable_prefix_caching": ns.enable_prefix_caching,
           "batched": {"num_prompts": ns.batch_num_prompts, "input_len": ns.batch_input_len,
                       "output_len": ns.batch_output_len},
           "cpu_count": os.cpu_count(), "results": summary}
    if llamacpp is not None:
        out["llamacpp"] = {k: v for k, v in llamacpp.items() if k != "workloads"} | {
            "workloads": {w: {c: {k: v for k, v in e.items() if k != "output_ids"} for c, e in by.items()}
                          for w, by in llamacpp["workloads"].items()}}
    line = json.dumps(out)
    print(line)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            f.write(line + "\n")
    mismatched = any(v is False for d in identical.values() for v in d.values())
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
