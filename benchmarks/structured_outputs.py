"""What JSON-schema constraints cost: grammar compile time, and offline throughput of a batch whose
half is constrained vs the same batch unconstrained (alternating rounds, one process).

Every request runs exactly --output-len tokens (ignore_eos: a constrained reply goes on freely
once its JSON is complete), so both batches sample the same number of tokens and the difference
is the masks' cost.

    .venv/bin/python benchmarks/structured_outputs.py [--num-prompts 64] [--rounds 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.worker.structured_output import GrammarCompiler

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                         "address": {"type": "object", "required": ["city", "zip"], "additionalProperties": False,
                                     "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                        "pattern": "[0-9]{5}"}}}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    ns = parser.parse_args()
    llm = LLM()
    engine = llm.llm_engine
    start = time.perf_counter()
    compiler = GrammarCompiler(engine.tokenizer, engine.processor.vocab_size, engine.processor.eos_token_ids)
    info_s = time.perf_counter() - start
    compile_s = {}
    for name, spec in (("json schema", StructuredOutputsParams(json=SCHEMA)),
                       ("any JSON object", StructuredOutputsParams(json_object=True)),
                       ("regex", StructuredOutputsParams(regex=r"[A-Z][a-z]+ \d{1,3}")),
                       ("choice", StructuredOutputsParams(choice=["yes", "no", "maybe"]))):
        start = time.perf_counter()
        compiler.compile(spec)
        compile_s[name] = time.perf_counter() - start
    prompts = [f"Describe person number {i} as JSON." for i in range(ns.num_prompts)]
    free = SamplingParams(max_tokens=ns.output_len, ignore_eos=True, temperature=1.0, seed=0)
    constrained = SamplingParams(max_tokens=ns.output_len, ignore_eos=True, temperature=1.0, seed=0,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    batches = {"none constrained": [free] * len(prompts),
               "half constrained": [constrained if i % 2 else free for i in range(len(prompts))]}
    llm.generate(prompts[:8], batches["half constrained"][:8], use_tqdm=False)  # warm-up
    speeds: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(ns.rounds):
        for name, params in batches.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            speeds[name].append(tokens / (time.perf_counter() - start))
    print(f"tokenizer info for xgrammar: {info_s * 1e3:.0f} ms; compile: "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in compile_s.items()))
    base = statistics.median(speeds["none constrained"])
    for name, values in speeds.items():
        med = statistics.median(values)
        print(f"{name}: output tokens/s {', '.join(f'{v:.1f}' for v in values)} (median {med:.1f}, "
              f"{med / base:.3f}x of none)")


if __name__ == "__main__":
    main()
