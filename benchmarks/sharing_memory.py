"""Memory saved by block sharing, measured on the real engine and model (PagedAttention paper, Fig. 15).

Alpaca-like requests (prompt and output lengths drawn from the same distribution as
`pagedllm bench memory --trace alpaca`, prompts made of the default model's vocabulary) run
through the real engine with parallel sampling (n samples forked from one prompt) and with
beam search (beams forked every step). After every step we count the KV blocks actually in
use (shared blocks once) and the blocks the same sequences would hold without sharing (each
block table on its own). Saving = 1 - sum(in use) / sum(unshared), over all steps.
Prefix caching is off, so only forking shares.

    .venv/bin/python benchmarks/sharing_memory.py --num-requests 16
"""
from __future__ import annotations

import argparse
import json
import random

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.entrypoints.bench.traces import TRACE_SPECS, draw_lengths


def measure(llm: LLM, requests: list[tuple[list[int], int]], mode: str, width: int) -> dict:
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    for i, (prompt, out_len) in enumerate(requests):
        if mode == "parallel_sampling":
            engine.add_request(f"{mode}{width}-{i}", {"prompt_token_ids": prompt},
                               SamplingParams(n=width, temperature=1.0, seed=i, max_tokens=out_len, ignore_eos=True))
        else:
            engine.add_beam_request(f"{mode}{width}-{i}", {"prompt_token_ids": prompt},
                                    BeamSearchParams(beam_width=width, max_tokens=out_len, ignore_eos=True))
    used = unshared = 0
    while engine.has_unfinished_requests():
        engine.step()
        used += kv.block_pool.num_usable_blocks - kv.num_free_blocks
        unshared += sum(len(blocks) for blocks in kv.req_to_blocks.values())
    return {"mode": mode, "width": width, "block_steps_in_use": used, "block_steps_unshared": unshared,
            "saving": 1 - used / unshared}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, enable_prefix_caching=False, num_kv_blocks=4096, block_size=16)
    vocab = llm.llm_engine.processor.vocab_size
    rng = random.Random(args.seed)
    lengths = draw_lengths(TRACE_SPECS["alpaca"], args.num_requests, 2048, args.seed)
    requests = [([rng.randrange(vocab) for _ in range(p)], o) for p, o in lengths]
    rows = [measure(llm, requests, mode, width) for mode in ("parallel_sampling", "beam_search")
            for width in (2, 4, 6)]
    print(f"{'mode':<20}{'n / width':>10}{'block-steps in use':>20}{'unshared':>12}{'saving':>9}")
    for r in rows:
        print(f"{r['mode']:<20}{r['width']:>10}{r['block_steps_in_use']:>20}{r['block_steps_unshared']:>12}"
              f"{r['saving']:>9.1%}")
    print(json.dumps({"num_requests": args.num_requests, "seed": args.seed, "rows": rows}))


if __name__ == "__main__":
    main()
