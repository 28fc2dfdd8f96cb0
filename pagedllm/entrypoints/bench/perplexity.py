"""``pagedllm bench perplexity``: a model's perplexity on a text file (as llama.cpp's perplexity tool).

The text is tokenized once; its tokens are cut into consecutive windows of ``--context`` tokens
(the last, shorter one included when it has two tokens or more); each window is one request whose
prompt log-probabilities (``prompt_logprobs=0``: the log-probability of each actual next token)
score every token of the window but its first. Perplexity = exp(mean negative log-probability).
Used to measure what quantization costs (docs/BENCHMARKS.md: the same windows given to llama.cpp).
"""
from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from pagedllm.entrypoints.bench import emit_json
from pagedllm.entrypoints.cli_args import SubParsers, add_engine_args, engine_args_from
from pagedllm.errors import ValidationError

if TYPE_CHECKING:
    from pagedllm.entrypoints.llm import LLM


def windows(token_ids: list[int], context: int) -> list[list[int]]:
    """Consecutive windows of ``context`` tokens (the last one shorter), each of two tokens or more."""
    if context < 2:
        raise ValidationError.bad_value("context", context, "an integer >= 2")
    return [w for w in (token_ids[i:i + context] for i in range(0, len(token_ids), context)) if len(w) >= 2]


def negative_log_likelihoods(llm: LLM, token_ids: list[int], context: int = 512) -> list[float]:
    """-log p(token | the tokens before it in its window), for every token but each window's first."""
    from pagedllm.sampling_params import SamplingParams

    parts = windows(token_ids, context)
    if not parts:
        raise ValidationError(f"the text has {len(token_ids)} token(s): perplexity needs at least 2", param="file")
    outs = llm.generate([{"prompt_token_ids": w} for w in parts], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    nll = []
    for window, out in zip(parts, outs):
        for token, entry in zip(window[1:], out.prompt_logprobs[1:]):
            nll.append(-entry[token].logprob)
    return nll


def perplexity(llm: LLM, token_ids: list[int], context: int = 512) -> float:
    nll = negative_log_likelihoods(llm, token_ids, context)
    return math.exp(sum(nll) / len(nll))


def add_parser(sub: SubParsers) -> None:
    p = sub.add_parser("perplexity", help="perplexity of the model on a text file", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", required=True, help="a UTF-8 text file")
    p.add_argument("--context", type=int, default=512, help="tokens per window (default: 512)")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from pagedllm.entrypoints.llm import LLM

    with open(ns.file, encoding="utf-8") as f:
        text = f.read()
    llm = LLM(**vars(engine_args_from(ns)))
    try:
        ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
        nll = negative_log_likelihoods(llm, ids, ns.context)
        config = llm.llm_engine.config.model
        emit_json({"perplexity": math.exp(sum(nll) / len(nll)), "scored_tokens": len(nll), "tokens": len(ids),
                   "context": ns.context, "model": config.model, "dtype": config.dtype,
                   "quantization": config.quantization,
                   "kv_cache_dtype": llm.llm_engine.config.cache.cache_dtype}, None)
    finally:
        llm.shutdown()
    return 0
