"""``pagedllm bench latency``: the latency of one batch of offline generation (as vLLM's ``bench latency``)."""
from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from pagedllm.entrypoints.bench import emit_json, load_line, load_summary
from pagedllm.entrypoints.bench.datasets import random_prompts
from pagedllm.entrypoints.cli_args import SubParsers, add_engine_args, engine_args_from
from pagedllm.errors import ValidationError

PERCENTAGES = (10, 25, 50, 75, 90, 99)
DUMMY_VOCAB = 10000
"""Random prompt ids are drawn from [0, min(this, vocab size)), as vLLM's draw from [0, 10000)."""

DESCRIPTION = f"""\
Latency of one batch: --batch-size prompts of --input-len random token ids (ids below
{DUMMY_VOCAB}, seeded with --seed), or --batch-size copies of the text of --prompt-file, are
generated together by LLM.generate with SamplingParams(n, temperature, top_p=1.0, ignore_eos,
max_tokens=--output-len), --num-iters-warmup times untimed, then --num-iters times timed, each
call from submission to the last token (as vLLM's benchmark; prefix caching is off unless
--enable-prefix-caching, so no iteration reuses another's K/V). --use-beam-search runs
LLM.beam_search with beam width --n instead.

Prints the mean, standard deviation and {"/".join(map(str, PERCENTAGES))}th percentiles of the
latencies and the output tokens per second (output_len x batch_size x n / mean latency, and per
sequence output_len / mean latency), then one JSON line with vLLM's keys avg_latency,
std_latency, latencies and percentiles, plus output_tokens_per_second,
output_tokens_per_second_per_sequence, engine steps per iteration and, with a
--speculative-config, the drafts' acceptance (a prompt-grounded --prompt-file, e.g. a passage to
summarise or edit at --temperature 0, is where prompt-lookup drafts are accepted).
"""


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("latency", help="latency of one batch of offline generation (as vLLM's)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens (random ids) of each request (default: 32; not with --prompt-file)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per sequence (default: 128)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch (default: 8)")
    p.add_argument("--n", type=int, default=1, help="sequences generated per prompt; the beam width with "
                                                    "--use-beam-search (default: 1)")
    p.add_argument("--use-beam-search", action="store_true", help="LLM.beam_search instead of sampling")
    p.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first (default: 10)")
    p.add_argument("--num-iters", type=int, default=30, help="timed iterations (default: 30)")
    p.add_argument("--output-json", default=None, help="also write the JSON result to this file")
    p.add_argument("--disable-detokenize", action="store_true",
                   help="vLLM's flag; refused: pagedllm always detokenizes, inside the measured time")
    p.add_argument("--prompt-file", default=None,
                   help="a UTF-8 text file whose text is every prompt of the batch, instead of random ids")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature; 0 is greedy (default: 1.0, as vLLM's; beam search: 0 only)")
    actions = add_engine_args(p)
    # as vLLM's: a prefix cache would let every iteration after the first skip its prefill
    p.set_defaults(enable_prefix_caching=False)
    actions["enable_prefix_caching"].help = (actions["enable_prefix_caching"].help.split(" (default")[0]
                                             + " (default here: False, as vLLM's bench latency)")
    p.set_defaults(func=run)


def check_args(ns: argparse.Namespace) -> None:
    """Refuse what cannot be benchmarked before a model is loaded; the error names the flag."""
    def bad(flag: str, value: Any, expected: str) -> ValidationError:
        return ValidationError(f"{flag} must be {expected}, got {value!r}", param=flag[2:].replace("-", "_"),
                               value=value)

    for flag, minimum in (("--output-len", 1), ("--batch-size", 1), ("--n", 1), ("--num-iters", 1),
                          ("--num-iters-warmup", 0)):
        value = getattr(ns, flag[2:].replace("-", "_"))
        if value < minimum:
            raise bad(flag, value, f"an integer >= {minimum}")
    if ns.input_len is not None and ns.prompt_file is not None:
        raise ValidationError("--input-len and --prompt-file exclude each other: the prompt's length is the "
                              "token count of the file's text", param="input_len", value=ns.input_len)
    if ns.input_len is not None and ns.input_len < 1:
        raise bad("--input-len", ns.input_len, "an integer >= 1")
    if ns.temperature is not None and not ns.temperature >= 0.0:  # NaN fails too
        raise bad("--temperature", ns.temperature, "a number >= 0")
    if ns.use_beam_search and ns.temperature:
        raise bad("--temperature", ns.temperature, "0 with --use-beam-search (beam search is deterministic)")
    if ns.disable_detokenize:
        raise ValidationError("--disable-detokenize is not supported: pagedllm's engine detokenizes every "
                              "output token (SamplingParams has no detokenize switch); drop the flag",
                              param="disable_detokenize", value=True)


def read_prompt_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValidationError(f"--prompt-file {path!r} cannot be read: {e}", param="prompt_file", value=path) from e
    if not text.strip():
        raise ValidationError(f"--prompt-file {path!r} is empty", param="prompt_file", value=path)
    return text


def latency_result(latencies: list[float], output_tokens: int, num_sequences: int) -> dict[str, Any]:
    """vLLM's keys (avg_latency, std_latency, latencies, percentiles keyed "10" ... "99" once in JSON) and
    the output tokens per second of the batch and per sequence."""
    values = np.array(latencies)
    avg = float(values.mean())
    return {
        "avg_latency": avg,
        "std_latency": float(values.std()),
        "latencies": values.tolist(),
        "percentiles": dict(zip(PERCENTAGES, np.percentile(values, PERCENTAGES).tolist())),
        "output_tokens_per_second": output_tokens / avg,
        "output_tokens_per_second_per_sequence": output_tokens / num_sequences / avg,
    }


def spec_decode_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """The drafts verified between two engine stats (``vars(llm.get_stats())``) and how many were accepted;
    None when nothing was drafted (no speculative_config, or no draft found)."""
    drafts, draft_tokens, accepted = (after.get(k, 0) - before.get(k, 0) for k in (
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
    if not draft_tokens:
        return None
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens,
            # vLLM's mean acceptance length: tokens per verified draft, the model's own one included
            "mean_acceptance_length": 1 + accepted / drafts}


def run(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import BeamSearchParams, SamplingParams

    check_args(ns)
    text = read_prompt_file(ns.prompt_file) if ns.prompt_file is not None else None
    llm = LLM(**vars(engine_args_from(ns)))
    try:
        engine = llm.llm_engine
        prompts = _prompts(ns, llm, text)
        input_len = len(prompts[0]["prompt_token_ids"])
        temperature = 1.0 if ns.temperature is None else ns.temperature
        sampling = SamplingParams(n=ns.n, temperature=temperature, top_p=1.0, ignore_eos=True,
                                  max_tokens=ns.output_len)

        def run_once() -> float:
            start = time.perf_counter()
            if ns.use_beam_search:
                llm.beam_search(prompts, BeamSearchParams(beam_width=ns.n, max_tokens=ns.output_len, ignore_eos=True),
                                use_tqdm=False)
            else:
                llm.generate(prompts, sampling, use_tqdm=False)
            return time.perf_counter() - start

        print("Warming up...")
        for _ in tqdm(range(ns.num_iters_warmup), desc="Warmup iterations"):
            run_once()
        before = vars(llm.get_stats()).copy()
        latencies = [run_once() for _ in tqdm(range(ns.num_iters), desc="Bench iterations")]
        after = vars(llm.get_stats())
        load = load_summary(engine.rank_memory_usage())
    finally:
        llm.shutdown()

    result = latency_result(latencies, ns.output_len * ns.batch_size * ns.n, ns.batch_size * ns.n)
    result.update({
        "input_len": input_len, "output_len": ns.output_len, "batch_size": ns.batch_size, "n": ns.n,
        "num_iters": ns.num_iters, "num_iters_warmup": ns.num_iters_warmup, "use_beam_search": ns.use_beam_search,
        "temperature": 0.0 if ns.use_beam_search else temperature, "prompt_file": ns.prompt_file,
        "dtype": engine.config.model.dtype,
        "steps_per_iteration": (after["num_steps"] - before["num_steps"]) / ns.num_iters, **load,
    })
    spec = spec_decode_summary(before, after)
    if spec is not None:
        result["spec_decode"] = spec
    _report(ns, result, load, input_len)
    emit_json(result, ns.output_json)
    return 0


def _prompts(ns: argparse.Namespace, llm: Any, text: str | None) -> list[dict[str, list[int]]]:
    """The batch's prompts as token ids: --prompt-file's text tokenized as the engine would, else random ids;
    refused when a request cannot fit max_model_len."""
    engine = llm.llm_engine
    if text is not None:
        prompt_ids = list(llm.get_tokenizer().encode(text))  # as the engine tokenizes a text prompt
        prompts = [{"prompt_token_ids": prompt_ids}] * ns.batch_size
    else:
        prompts = random_prompts(ns.batch_size, ns.input_len or 32, min(DUMMY_VOCAB, engine.processor.vocab_size),
                                 ns.seed)
    input_len = len(prompts[0]["prompt_token_ids"])
    max_model_len = engine.config.model.max_model_len
    if input_len + ns.output_len > max_model_len:
        raise ValidationError(f"a request needs {input_len} + {ns.output_len} tokens, more than max_model_len "
                              f"{max_model_len}", param="max_model_len", value=max_model_len)
    return prompts


def _report(ns: argparse.Namespace, result: dict[str, Any], load: dict[str, Any], input_len: int) -> None:
    """vLLM's printed lines of `bench latency`, and ours (tokens/s, steps, load, speculation)."""
    print(f"Avg latency: {result['avg_latency']} seconds")
    print(f"Std latency: {result['std_latency']} seconds")
    for percentage, value in result["percentiles"].items():
        print(f"{percentage}% percentile latency: {value} seconds")
    print(f"Output tokens/s: {result['output_tokens_per_second']:.2f} total, "
          f"{result['output_tokens_per_second_per_sequence']:.2f} per sequence "
          f"({ns.batch_size} x {ns.n} sequences of {ns.output_len} tokens, prompts of {input_len} tokens), "
          f"{result['steps_per_iteration']:.1f} engine steps per iteration")
    print(load_line(load))
    if "spec_decode" in result:
        sd = result["spec_decode"]
        print(f"Speculative decoding: acceptance rate {sd['acceptance_rate']:.3f}, "
              f"mean acceptance length {sd['mean_acceptance_length']:.2f}")
