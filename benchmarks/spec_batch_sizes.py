"""Where speculation stops paying: output tokens/s of B copies of one input-grounded chat request (a rename in
code, greedy, prefix caching on) with and without prompt-lookup speculation, B = 1 .. 64. The batch-size rule
of speculative_config (``disable_by_batch_size``) is set from this; the two engines alternate, best of
``--rounds`` runs each.

    .venv/bin/python benchmarks/spec_batch_sizes.py [--max-tokens 128] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pagedllm import LLM, SamplingParams

CODE = (Path(__file__).resolve().parents[1] / "pagedllm" / "core" / "block_pool.py").read_text()[:2500]
MESSAGES = [{"role": "user", "content": "Rename the variable `block` to `blk` in this code and return all of it:\n\n"
             + CODE}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
            "disable_by_batch_size": None}  # speculate at every size: the rule is what this measures
    llms = {"none": LLM(), "ngram": LLM(speculative_config=spec)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in llms.values():  # warm-up (and the prompt's blocks in the prefix cache)
        llm.chat(MESSAGES, SamplingParams(max_tokens=4), use_tqdm=False)
    rows = []
    for batch in args.batches:
        best = {name: 0.0 for name in llms}
        for _ in range(args.rounds):
            for name, llm in llms.items():
                start = time.perf_counter()
                outs = llm.chat([MESSAGES] * batch, params, use_tqdm=False)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                best[name] = max(best[name], tokens / (time.perf_counter() - start))
        rows.append({"batch": batch, **{k: round(v, 1) for k, v in best.items()},
                     "ratio": round(best["ngram"] / best["none"], 2)})
        print(json.dumps(rows[-1]), flush=True)
    print("\n| sequences | " + " | ".join(str(r["batch"]) for r in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for key in ("none", "ngram", "ratio"):
        print(f"| {key} | " + " | ".join(str(r[key]) for r in rows) + " |")


if __name__ == "__main__":
    main()
