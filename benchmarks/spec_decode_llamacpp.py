"""llama.cpp's prompt-lookup decoding (llama-cpp-python's LlamaPromptLookupDecoding) on the single-stream
prompts of benchmarks/spec_decode.py, with and without it. Run with the llama-cpp peer's Python
(../shared/peers/README.md), on the prompts that spec_decode.py exports (chat-templated token ids):

    .venv/bin/python benchmarks/spec_decode.py --export-prompts prompts.json --workloads none
    GGUF=$(.venv/bin/python -c 'from pagedllm.models.loader import resolve_model_path as r; print(r(None))')
    ~/.cache/pagedllm-peers/llama-cpp/bin/python benchmarks/spec_decode_llamacpp.py --gguf "$GGUF" \\
        --prompts prompts.json --rounds 3 --max-tokens 384 --num-pred-tokens 2,10

(`benchmarks/spec_decode.py --llamacpp-python PATH` runs it for you.) One Llama per configuration
(all loaded first): `none` (no draft model) and `lookup-N` for each --num-pred-tokens N
(draft_model=LlamaPromptLookupDecoding(max_ngram_size=--max-ngram-size, num_pred_tokens=N); note
that llama-cpp-python then keeps the logits of every evaluated token, prompt included). The
configurations alternate round by round. Each prompt is generated alone through Llama.generate
(greedy: temp 0, repeat_penalty 1), from an emptied cache (Llama.reset(): no prefix reuse), until an
end-of-generation token (kept in the output ids, as pagedllm's are) or --max-tokens tokens.
n_threads = n_threads_batch = --threads (default os.cpu_count()).

tok/s = output tokens / wall time of the generation, summed over a workload's prompts (prompt eval
included, nothing subtracted); median over rounds; speedup vs none; identical: whether every
prompt's output ids equal those of `none` in the same round (MISMATCH lines otherwise).
Prints a table and one RESULT {json} line (with every configuration's round-1 output ids).
"""
import argparse
import json
import os
import statistics
import sys
import time

import llama_cpp
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--gguf", required=True, help="the GGUF file (pagedllm's default model: resolve_model_path(None))")
ap.add_argument("--prompts", required=True, help="JSON from `benchmarks/spec_decode.py --export-prompts`")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--max-tokens", type=int, default=None, help="default: the file's max_tokens")
ap.add_argument("--num-pred-tokens", default="2,10",
                help="comma-separated num_pred_tokens values, one configuration each (default 2,10)")
ap.add_argument("--max-ngram-size", type=int, default=2, help="LlamaPromptLookupDecoding max_ngram_size (2)")
ap.add_argument("--threads", type=int, default=os.cpu_count())
ap.add_argument("--workloads", default=None, help="comma-separated workloads of the file (default: all)")
ap.add_argument("--extra-bufts", type=int, default=1,
                help="0 turns ggml's extra buffer types (AMX, repacking) off, for CPUs where they crash")
args = ap.parse_args()

with open(args.prompts) as f:
    data = json.load(f)
max_tokens = args.max_tokens or data.get("max_tokens", 384)
workloads = {w: ps for w, ps in data["workloads"].items()
             if args.workloads is None or w in args.workloads.split(",")}
longest = max(len(p["ids"]) for ps in workloads.values() for p in ps)
n_ctx = longest + max_tokens + 64  # + room for the last draft

if not args.extra_bufts:
    _default_params = llama_cpp.llama_cpp.llama_model_default_params

    def _params_without_extra_bufts():
        params = _default_params()
        params.use_extra_bufts = False
        return params

    llama_cpp.llama_cpp.llama_model_default_params = _params_without_extra_bufts

configs = {"none": None}
for n in (int(x) for x in args.num_pred_tokens.split(",") if x.strip()):
    configs[f"lookup-{n}"] = n
llms = {}
for name, n in configs.items():
    draft = None if n is None else LlamaPromptLookupDecoding(max_ngram_size=args.max_ngram_size, num_pred_tokens=n)
    llms[name] = llama_cpp.Llama(model_path=args.gguf, n_ctx=n_ctx, n_batch=512, n_threads=args.threads,
                                 n_threads_batch=args.threads, draft_model=draft, verbose=False,
                                 logits_all=draft is not None)  # verifying drafts reads every row's logits


def generate(llm, ids):
    """Greedy output ids (the end-of-generation token kept) and seconds."""
    llm.reset()
    vocab = llm._model.vocab
    out = []
    start = time.perf_counter()
    for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        out.append(int(tok))
        if llama_cpp.llama_vocab_is_eog(vocab, tok) or len(out) >= max_tokens:
            break
    return out, time.perf_counter() - start


for llm in llms.values():  # warm-up
    generate(llm, list(workloads.values())[0][0]["ids"][:32])

runs = {w: {c: [] for c in configs} for w in workloads}
for r in range(args.rounds):
    for w, ps in workloads.items():
        for c, llm in llms.items():
            per_prompt = [generate(llm, p["ids"]) for p in ps]
            tokens = sum(len(ids) for ids, _ in per_prompt)
            seconds = sum(s for _, s in per_prompt)
            runs[w][c].append({"ids": [ids for ids, _ in per_prompt], "tokens": tokens, "seconds": seconds,
                               "tok_s": tokens / seconds, "per_prompt_tok_s": [len(i) / s for i, s in per_prompt]})
            print(f"round {r + 1}/{args.rounds} {w:<8} {c:<10} {tokens / seconds:8.1f} tok/s  "
                  f"{tokens:6d} output tokens in {seconds:6.2f} s", flush=True)

result = {"system": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "gguf": os.path.basename(args.gguf),
          "threads": args.threads, "rounds": args.rounds, "max_tokens": max_tokens, "n_ctx": n_ctx,
          "max_ngram_size": args.max_ngram_size, "extra_bufts": bool(args.extra_bufts), "workloads": {}}
print("\n| workload | config | tok/s median | per round | speedup vs none | identical to none |")
print("|---|---|---:|---|---:|---|")
for w, ps in workloads.items():
    base = statistics.median(x["tok_s"] for x in runs[w]["none"])
    result["workloads"][w] = {}
    for c in configs:
        per_round = [x["tok_s"] for x in runs[w][c]]
        identical = all(x["ids"] == ref["ids"] for x, ref in zip(runs[w][c], runs[w]["none"]))
        for r, (x, ref) in enumerate(zip(runs[w][c], runs[w]["none"])):
            for p, a, b in zip(ps, ref["ids"], x["ids"]):
                if a != b:
                    i = next((k for k, (s, t) in enumerate(zip(a, b)) if s != t), min(len(a), len(b)))
                    print(f"MISMATCH {w}/{p['name']}: llama.cpp {c} round {r + 1} differs from none at output "
                          f"token {i} (lengths {len(a)} / {len(b)})")
        med = statistics.median(per_round)
        result["workloads"][w][c] = {
            "tok_s_per_round": per_round, "tok_s_median": med, "speedup_vs_none": med / base,
            "identical_to_none": None if c == "none" else identical,
            "output_tokens": runs[w][c][0]["tokens"],
            "per_prompt_tok_s_median": {p["name"]: statistics.median(x["per_prompt_tok_s"][i] for x in runs[w][c])
                                        for i, p in enumerate(ps)},
            "output_ids": runs[w][c][0]["ids"]}
        print(f"| {w} | {c} | {med:.1f} | {' / '.join(f'{x:.1f}' for x in per_round)} | {med / base:.2f} "
              f"| {'-' if c == 'none' else ('yes' if identical else 'NO')} |")
sys.stdout.flush()
print("RESULT " + json.dumps(result))
