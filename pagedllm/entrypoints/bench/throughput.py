"""``pagedllm bench throughput``: offline throughput on random-token prompts (as vLLM's benchmark)."""
from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pagedllm.entrypoints.cli import add_engine_args

    p = sub.add_parser("throughput", help="offline throughput on random-token prompts")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument("--output-json", default=None, help="also write the JSON result to this file")
    add_engine_args(p)
    p.set_defaults(func=run)


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[dict]:
    """``num`` prompts of ``input_len`` uniformly random token ids (seeded)."""
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, vocab_size, input_len).tolist()} for _ in range(num)]


def run(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.cli import engine_args_from
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(**vars(engine_args_from(ns)))
    vocab = llm.llm_engine.processor.vocab_size
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=ns.output_len)
    llm.generate(random_prompts(4, ns.input_len, vocab, ns.dataset_seed + 1), params, use_tqdm=False)  # warm-up
    prompts = random_prompts(ns.num_prompts, ns.input_len, vocab, ns.dataset_seed)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "dtype": llm.llm_engine.config.model.dtype,
        "stats": {k: v for k, v in vars(llm.get_stats()).items() if k in ("num_steps", "num_preemptions", "max_num_running")},
    }
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Requests: {len(outputs)} x ({ns.input_len} in / {ns.output_len} out), elapsed {elapsed:.2f} s, "
          f"peak RSS {result['peak_rss_mib']:.0f} MiB")
    line = json.dumps(result)
    print(line)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            f.write(line + "\n")
    return 0
