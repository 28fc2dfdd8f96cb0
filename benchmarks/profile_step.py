"""Time (and optionally profile) decode steps at a fixed batch size and context length.

    .venv/bin/python benchmarks/profile_step.py --batch 256 --context 190 --steps 10 --profile
    .venv/bin/python benchmarks/profile_step.py --model ~/.cache/pagedllm-bench/smollm2-1.7b/hf --load-format dummy \
        --dtype bfloat16 --batch 32 --context 128 --op-times     # a big_models shape

Adds ``--batch`` requests of ``--context`` random tokens to an engine on the default model,
steps until every one is decoding, then times ``--steps`` calls of ``engine.step()`` (each a
decode step of the whole batch) and, with ``--profile``, prints a ``torch.profiler`` table of
5 more. The compiled kernels are not torch ops, so their time appears only in the step total;
``--op-times`` wraps the kernels and the matmuls with timers and prints milliseconds per step
for each (the rest of the step is torch ops and Python). ``PAGEDLLM_ISA=avx2`` profiles that level.
Where the decoder layers run as one compiled call (models/cpu_stack.py) they show as ``llama_stack``;
``PAGEDLLM_CPU_STACK=0`` runs them one by one, so that each kernel gets its own line.
"""
from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pagedllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=190, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default=None, help="an HF folder or GGUF file (default: the default model)")
    parser.add_argument("--load-format", default="auto", help='"dummy": random weights of --model\'s shape')
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV pool")
    parser.add_argument("--kv-cache-dtype", default="auto", help='"int8": the int8 KV cache')
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--op-times", action="store_true", help="time each C++ kernel and matmul per step")
    args = parser.parse_args()

    extra = {} if args.kv_cache_memory is None else {"kv_cache_memory": args.kv_cache_memory}
    if args.kv_cache_dtype != "auto":
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    llm = LLM(**({"model": args.model} if args.model else {}), dtype=args.dtype, seed=0, load_format=args.load_format,
              **extra)
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, max_tokens=args.steps + 40, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), {"prompt_token_ids": rng.integers(1000, 40000, args.context).tolist()}, params)
    running = engine.engine_core.core.scheduler.running  # the in-process core (LLM runs it in this thread)
    while not (len(running) == args.batch and all(r.output_token_ids for r in running)):
        engine.step()
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    print(f"batch {args.batch}, context ~{args.context}: "
          f"{(time.perf_counter() - start) / args.steps * 1e3:.1f} ms/step")
    if args.op_times:
        times = _wrap_ops()
        for _ in range(args.steps):
            engine.step()
        for name, total in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<22} {total / args.steps * 1e3:6.1f} ms/step")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


def _wrap_ops() -> dict[str, float]:
    """Replace the compiled kernels' calls and the linear helper with timed wrappers; returns the running totals."""
    import pagedllm.layers.embedding as embedding
    import pagedllm.layers.linear as linear
    from pagedllm.layers.cpu_ops import active

    times: dict[str, float] = collections.defaultdict(float)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name] += time.perf_counter() - start
        return wrapper

    kernels = active()
    if kernels is not None:  # instance attributes shadow the methods: every caller goes through the timers
        for name in ("llama_stack", "paged_attention", "write_kv", "rms_norm", "rotary_inplace", "silu_and_mul",
                     "sample", "argmax", "qgemm"):
            setattr(kernels, name, timed(name, getattr(kernels, name)))
    for module, attr, name in ((linear, "matmul_for", "matmul_for (layers)"),
                               (linear, "silu_and_mul_linear", "gate_up + SiLU (fused)"),
                               (embedding, "matmul_for", "matmul_for (LM head)")):
        if hasattr(module, attr):  # the helpers these modules import today; a renamed one is skipped, not fatal
            setattr(module, attr, timed(name, getattr(module, attr)))
    return times


if __name__ == "__main__":
    main()
