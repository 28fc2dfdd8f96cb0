"""transformers' static batching on the workload of `pagedllm bench throughput` (the baseline).

Same random-token prompts (same seed and generator), same output length, EOS ignored
(min_new_tokens = max_new_tokens), sampling at temperature 1.0. Prompts are processed in
fixed batches: a batch ends when its longest request ends, and nobody joins mid-way.

    .venv/bin/python benchmarks/hf_static_batching.py --input-len 128 --output-len 128 --num-prompts 256
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GgufConfig

from pagedllm.entrypoints.bench.datasets import random_prompts
from pagedllm.models.loader import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--dataset-seed", type=int, default=0)
    args = ap.parse_args()
    path = default_model_path()
    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, args.dtype),
                                                 quantization_config=GgufConfig(gguf_file=path, dequantize=True)).eval()
    vocab = model.config.vocab_size
    prompts = [p["prompt_token_ids"]
               for p in random_prompts(args.num_prompts, args.input_len, vocab, args.dataset_seed)]
    gen = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.output_len,
               min_new_tokens=args.output_len, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:2]), **{**gen, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        start = time.perf_counter()
        output_tokens = 0
        for i in tqdm(range(0, len(prompts), args.batch_size), desc="batches"):
            batch = torch.tensor(prompts[i:i + args.batch_size])  # equal lengths: no padding needed
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **gen)
            output_tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        elapsed = time.perf_counter() - start
    total = args.num_prompts * args.input_len + output_tokens
    result = {"engine": "transformers-static", "dtype": args.dtype, "batch_size": args.batch_size,
              "elapsed_time": elapsed, "num_requests": args.num_prompts, "total_num_tokens": total,
              "requests_per_second": args.num_prompts / elapsed, "tokens_per_second": total / elapsed,
              "output_tokens_per_second": output_tokens / elapsed,
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
          f"tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
