"""``pagedllm bench throughput`` (offline throughput, as vLLM's) and ``pagedllm bench make-dataset``."""
from __future__ import annotations

import argparse
import json
import resource
import time
from typing import TYPE_CHECKING

from pagedllm.entrypoints.bench import emit_json, load_line, load_summary
from pagedllm.entrypoints.bench.datasets import (
    SHAREGPT_MAX_PROMPT_LEN,
    SHAREGPT_MAX_TOTAL_LEN,
    SHAREGPT_MIN_LEN,
    SYNTHETIC,
    WORD_TOKEN_LOW,
    BenchRequest,
    add_dataset_args,
    check_dataset_args,
    dataset_seed,
    describe_synthetic,
    random_requests,
    requests_from_args,
    summarize,
    write_sharegpt_file,
)
from pagedllm.entrypoints.cli_args import SubParsers, add_engine_args, engine_args_from
from pagedllm.errors import ValidationError

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM

_INDENT = "\n" + " " * 17
DESCRIPTION = f"""\
Offline throughput: every request is submitted at once to LLM.generate, with temperature 1.0,
top_p 1.0, ignore_eos and max_tokens = the request's output length (as vLLM's benchmark).

Datasets (--dataset-name):
  random         input/output lengths uniform over the integers in
                 [floor(len*(1-r)), ceil(len*(1+r))], len = --random-input-len /
                 --random-output-len, r = --random-range-ratio; prompts of random token ids.
  sharegpt-like  lengths of the synthetic traces of `pagedllm bench memory` (seeded; the
  alpaca-like    means are the PagedAttention paper's), prompts of random token ids.
                 Lognormal lengths (mean before clipping, log-space sigma):
                 {describe_synthetic(_INDENT)}
                 each length >= 4, prompt + output <= min({SHAREGPT_MAX_TOTAL_LEN}, max_model_len).
  sharegpt       a ShareGPT JSON file (--dataset-path), read as vLLM reads it: entries with at
                 least 2 turns, shuffled with --seed; prompt = first turn, output length =
                 tokens of the second turn; pairs with prompt or output < {SHAREGPT_MIN_LEN} tokens,
                 prompt > {SHAREGPT_MAX_PROMPT_LEN} or prompt + output > {SHAREGPT_MAX_TOTAL_LEN} are skipped;
                 the first --num-prompts valid ones are taken (oversampled if fewer).
                 `pagedllm bench make-dataset` writes such a file from sharegpt-like / alpaca-like.

The result line (JSON) has vLLM's keys elapsed_time, num_requests, total_num_tokens (prompt +
generated tokens), requests_per_second, tokens_per_second, plus output_tokens_per_second,
dataset_name and a few of ours (per-rank memory under "ranks").
"""

MAKE_DATASET_DESCRIPTION = f"""\
Writes a ShareGPT-format JSON ([{{"conversations": [{{"from": "human", "value": ...}},
{{"from": "gpt", "value": ...}}]}}, ...]) for a synthetic trace, so that every engine of a
comparison reads the same text (`pagedllm bench throughput --dataset-name sharegpt
--dataset-path FILE`, or vLLM's `bench throughput` with the same flags).

For each (prompt_len, output_len) drawn as `bench throughput --dataset-name sharegpt-like /
alpaca-like` draws them (lognormal; mean before clipping, log-space sigma):
  {describe_synthetic(chr(10) + "  ")}
each length >= 4, prompt + output <= {SHAREGPT_MAX_TOTAL_LEN}, the human turn is the decoded text of
prompt_len random word tokens and the gpt turn that of output_len of them. Word tokens: ids in
[{WORD_TOKEN_LOW}, vocab), no special tokens, and where the tokenizer has enough of them only those
that decode to a space and letters: such text tokenizes back to the drawn lengths (it does with
SmolLM2's tokenizer; others may come out a little longer or shorter). The ShareGPT loaders then
skip pairs with a prompt over {SHAREGPT_MAX_PROMPT_LEN} tokens (about 1.6 in 100 of sharegpt-like) and
oversample, both vLLM's and ours in the same way.
"""


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("throughput", help="offline throughput (random, synthetic or ShareGPT datasets)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_args(p)
    p.add_argument("--num-prompts", type=int, default=256, help="number of requests (default: 256)")
    p.add_argument("--output-json", default=None, help="also write the JSON result to this file")
    add_engine_args(p)["seed"].help = "seed of the engine and of the dataset (shuffle, lengths, token ids) (default: 0)"
    p.set_defaults(func=run)

    m = sub.add_parser("make-dataset", help="write a ShareGPT-format JSON of a synthetic trace",
                       description=MAKE_DATASET_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("--dataset-name", choices=sorted(SYNTHETIC), default="sharegpt-like",
                   help="synthetic trace (default: sharegpt-like)")
    m.add_argument("--num-prompts", type=int, default=256, help="number of conversations (default: 256)")
    m.add_argument("--seed", type=int, default=0, help="seed of the lengths and token ids (default: 0)")
    m.add_argument("--output", required=True, help="JSON file to write")
    m.add_argument("--model", default=None, help="whose tokenizer decodes the ids (default: SmolLM2-135M-Instruct)")
    m.set_defaults(func=make_dataset)


def build_requests(ns: argparse.Namespace, llm: LLM, seed: int) -> list[BenchRequest]:
    """The requests of the chosen dataset for this engine (its vocabulary, tokenizer and max_model_len)."""
    engine = llm.llm_engine
    return requests_from_args(ns, engine.processor.vocab_size, llm.get_tokenizer(), seed,
                              min(SHAREGPT_MAX_TOTAL_LEN, engine.config.model.max_model_len))


def warmup_requests(requests: list[BenchRequest], vocab_size: int, seed: int) -> list[BenchRequest]:
    """Random-token requests with the lengths of the first four: they warm the engine up without
    putting the benchmark's own prompts into the prefix cache."""
    return [random_requests(1, r.prompt_len, r.output_len, vocab_size, seed + 1 + i)[0]
            for i, r in enumerate(requests[:4])]


def run(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    check_dataset_args(ns)
    seed = dataset_seed(ns)
    llm = LLM(**vars(engine_args_from(ns)))
    requests = build_requests(ns, llm, seed)
    max_model_len = llm.llm_engine.config.model.max_model_len
    longest = max(requests, key=lambda r: r.prompt_len + r.output_len)
    if longest.prompt_len + longest.output_len > max_model_len:
        raise ValidationError(f"a request needs {longest.prompt_len} + {longest.output_len} tokens, more than "
                              f"max_model_len {max_model_len}", param="max_model_len", value=max_model_len)

    def params(output_len: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)

    warm = warmup_requests(requests, llm.llm_engine.processor.vocab_size, seed)
    llm.generate([r.as_prompt() for r in warm], [params(r.output_len) for r in warm], use_tqdm=False)

    start = time.perf_counter()
    outputs = llm.generate([r.as_prompt() for r in requests], [params(r.output_len) for r in requests])
    elapsed = time.perf_counter() - start
    ranks = llm.llm_engine.rank_memory_usage()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = {
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": prompt_tokens + output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "dataset_name": ns.dataset_name,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "dtype": llm.llm_engine.config.model.dtype,
        "tensor_parallel_size": llm.llm_engine.config.parallel.tensor_parallel_size,
        "ranks": [_in_mib(rank) for rank in ranks],
        **load_summary(ranks),
        "stats": {k: v for k, v in vars(llm.get_stats()).items()
                  if k in ("num_steps", "num_preemptions", "max_num_running")},
    }
    mean_in, mean_out = summarize(requests)
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    print(f"Requests: {len(outputs)} of dataset {ns.dataset_name} (mean {mean_in:.1f} in / {mean_out:.1f} out), "
          f"elapsed {elapsed:.2f} s, peak RSS {result['peak_rss_mib']:.0f} MiB")
    print(load_line(result))
    for rank, mem in enumerate(result["ranks"]):
        print(f"Rank {rank}: weights {mem['weights_mib']:.0f} MiB, KV cache {mem['kv_cache_mib']:.0f} MiB, "
              f"RSS {mem['rss_mib']:.0f} MiB")
    llm.shutdown()
    emit_json(result, ns.output_json)
    return 0


def _in_mib(rank: dict[str, float]) -> dict[str, float]:
    """A rank's ``rank_memory_usage`` with its byte counts in MiB (``weights_bytes`` -> ``weights_mib``)."""
    return {(key.removesuffix("_bytes") + "_mib" if key.endswith("_bytes") else key):
            (value / 2**20 if key.endswith("_bytes") else value) for key, value in rank.items()}


def make_dataset(ns: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import get_tokenizer

    summary = write_sharegpt_file(ns.output, ns.dataset_name, ns.num_prompts, ns.seed, get_tokenizer(ns.model))
    print(f"Wrote {summary['num_conversations']} {ns.dataset_name} conversations to {ns.output}: mean "
          f"{summary['mean_input_len']:.1f} in / {summary['mean_output_len']:.1f} out tokens once tokenized "
          f"(drawn {summary['mean_drawn_input_len']:.1f} / {summary['mean_drawn_output_len']:.1f}); "
          f"{summary['num_valid']} pass the ShareGPT loader's length filters")
    print(json.dumps(summary))
    return 0
