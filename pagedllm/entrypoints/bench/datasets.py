"""Workloads of ``pagedllm bench throughput``: random, synthetic traces and ShareGPT files.

Every loader returns :class:`BenchRequest` items (a prompt and the number of tokens to generate
for it); the benchmark sends each with temperature 1.0, top_p 1.0, ``ignore_eos`` and
``max_tokens`` = its output length, as vLLM's throughput benchmark does.

- ``random``: input / output lengths drawn uniformly from the integers in
  ``[floor(len * (1 - r)), ceil(len * (1 + r))]`` (r = range ratio in [0, 1)), prompts of random
  token ids. With r = 0 the prompts are exactly those of :func:`random_prompts`.
- ``sharegpt-like`` / ``alpaca-like``: lengths drawn from ``traces.TRACE_SPECS`` (seeded
  lognormals, see :func:`describe_synthetic`), prompts of random token ids.
- ``sharegpt``: a ShareGPT-format JSON file read with vLLM's rules (:func:`load_sharegpt`).

:func:`write_sharegpt_file` turns a synthetic trace into a ShareGPT-format file, so that every
engine of a comparison reads the very same text (``pagedllm bench make-dataset``).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedllm.entrypoints.bench.traces import TRACE_SPECS, TraceSpec, draw_lengths
from pagedllm.errors import ValidationError

DATASET_NAMES = ("random", "sharegpt-like", "alpaca-like", "sharegpt")
SYNTHETIC = {"sharegpt-like": "sharegpt", "alpaca-like": "alpaca"}
"""Synthetic dataset name -> key of ``traces.TRACE_SPECS``."""

SHAREGPT_MIN_LEN = 4
"""Pairs whose prompt or completion has fewer tokens are skipped (vLLM's rule)."""
SHAREGPT_MAX_PROMPT_LEN = 1024
"""Pairs whose prompt has more tokens are skipped (vLLM's rule)."""
SHAREGPT_MAX_TOTAL_LEN = 2048
"""Pairs whose prompt + completion have more tokens are skipped (vLLM's rule); also the
``max_model_len`` the synthetic traces are clipped to."""
WORD_TOKEN_LOW = 1000
"""Synthetic text is decoded from token ids in [WORD_TOKEN_LOW, vocab): ordinary word pieces,
well above the special and byte tokens at the start of the usual BPE vocabularies."""


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: a prompt (text or token ids), its length, and how many tokens to generate."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int

    def as_prompt(self) -> str | dict[str, list[int]]:
        """The prompt in the form ``LLM.generate`` takes."""
        return self.prompt if isinstance(self.prompt, str) else {"prompt_token_ids": self.prompt}


# ----------------------------------------------------------------------------- random
def length_bounds(length: int, range_ratio: float, minimum: int = 1) -> tuple[int, int]:
    """Inclusive ``[floor(length * (1 - r)), ceil(length * (1 + r))]``, both at least ``minimum``."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValidationError.bad_value("random_range_ratio", range_ratio, "in [0, 1)")
    if length < minimum:
        raise ValidationError.bad_value("length", length, f">= {minimum}")
    low = max(math.floor(length * (1 - range_ratio)), minimum)
    high = max(math.ceil(length * (1 + range_ratio)), low)
    return low, high


def random_requests(num: int, input_len: int, output_len: int, vocab_size: int, seed: int,
                    range_ratio: float = 0.0) -> list[BenchRequest]:
    """``num`` requests of random token ids in [0, vocab_size), lengths uniform around the given ones.

    Token ids come from ``default_rng(seed)`` in request order and lengths from a second
    generator, so with ``range_ratio = 0`` the prompts equal :func:`random_prompts`.
    """
    in_low, in_high = length_bounds(input_len, range_ratio)
    out_low, out_high = length_bounds(output_len, range_ratio)
    length_rng = np.random.default_rng([seed, 1])
    input_lens = length_rng.integers(in_low, in_high + 1, num)
    output_lens = length_rng.integers(out_low, out_high + 1, num)
    return _token_requests(zip(input_lens.tolist(), output_lens.tolist()), vocab_size, seed)


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int) -> list[dict]:
    """``num`` prompts of ``input_len`` uniformly random token ids (seeded), as ``LLM.generate`` takes them."""
    return [r.as_prompt() for r in random_requests(num, input_len, 1, vocab_size, seed)]


def _token_requests(lengths: Any, vocab_size: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    return [BenchRequest(rng.integers(0, vocab_size, p).tolist(), p, o) for p, o in lengths]


# -------------------------------------------------------------------------- synthetic
def trace_spec(name: str) -> TraceSpec:
    """The ``TRACE_SPECS`` entry behind a synthetic dataset name ("sharegpt-like" or "alpaca-like")."""
    if name not in SYNTHETIC:
        raise ValidationError.bad_value("dataset_name", name, f"one of {sorted(SYNTHETIC)}")
    return TRACE_SPECS[SYNTHETIC[name]]


def describe_synthetic(sep: str = "; ") -> str:
    """The synthetic datasets' lognormal length distributions (mean before clipping, log-space sigma)."""
    return sep.join(f"{name}: " + trace_spec(name).describe().split(": ", 1)[1] for name in SYNTHETIC)


def synthetic_lengths(name: str, num: int, seed: int,
                      max_total_len: int = SHAREGPT_MAX_TOTAL_LEN) -> list[tuple[int, int]]:
    """``num`` seeded (prompt_len, output_len) pairs of a synthetic trace (``traces.draw_lengths``).

    Each is clipped to at least 4 tokens and prompt + output <= ``max_total_len``.
    """
    return draw_lengths(trace_spec(name), num, max_total_len, seed)


def synthetic_requests(name: str, num: int, vocab_size: int, seed: int,
                       max_total_len: int = SHAREGPT_MAX_TOTAL_LEN) -> list[BenchRequest]:
    """Requests of random token ids in [0, vocab_size) with a synthetic trace's lengths."""
    return _token_requests(synthetic_lengths(name, num, seed, max_total_len), vocab_size, seed)


# --------------------------------------------------------------------------- sharegpt
def is_valid_pair(prompt_len: int, output_len: int) -> bool:
    """vLLM's ShareGPT filter: both >= 4 tokens, prompt <= 1024, prompt + output <= 2048."""
    return (prompt_len >= SHAREGPT_MIN_LEN and output_len >= SHAREGPT_MIN_LEN
            and prompt_len <= SHAREGPT_MAX_PROMPT_LEN and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN)


def read_sharegpt(path: str) -> list[dict]:
    """The entries of a ShareGPT JSON file that have at least two turns, in file order."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValidationError(f"dataset_path: no such file {path!r}", param="dataset_path", value=path) from None
    except json.JSONDecodeError as e:
        raise ValidationError(f"dataset_path: {path!r} is not JSON ({e})", param="dataset_path", value=path) from None
    if not isinstance(data, list):
        raise ValidationError(f"dataset_path: {path!r} must hold a JSON list of conversations",
                              param="dataset_path", value=path)
    return [e for e in data if isinstance(e, dict) and len(e.get("conversations") or ()) >= 2]


def load_sharegpt(path: str, num_prompts: int, tokenizer: Any, seed: int = 0) -> list[BenchRequest]:
    """``num_prompts`` requests from a ShareGPT file, chosen as vLLM's ShareGPT benchmark chooses them.

    Entries with fewer than two turns are dropped; the rest are shuffled with
    ``random.Random(seed)`` (the same permutation as vLLM's ``random.seed(seed); random.shuffle``)
    and walked in that order. The prompt is the first turn's text, the output length the token
    count of the second turn (``tokenizer.encode``, special tokens included as the tokenizer adds
    them); pairs failing :func:`is_valid_pair` are skipped, and the walk stops at ``num_prompts``.
    If fewer are valid, the list is filled up with draws from ``random.Random(seed).choice``, as
    vLLM oversamples. So with the same tokenizer both engines run the very same requests.
    """
    entries = read_sharegpt(path)
    random.Random(seed).shuffle(entries)
    requests: list[BenchRequest] = []
    for entry in entries:
        if len(requests) >= num_prompts:
            break
        prompt, completion = entry["conversations"][0]["value"], entry["conversations"][1]["value"]
        prompt_len, output_len = len(tokenizer.encode(prompt)), len(tokenizer.encode(completion))
        if is_valid_pair(prompt_len, output_len):
            requests.append(BenchRequest(prompt, prompt_len, output_len))
    if not requests:
        raise ValidationError(f"dataset_path: no conversation of {path!r} passes the length filters "
                              f"(prompt and output >= {SHAREGPT_MIN_LEN} tokens, prompt <= "
                              f"{SHAREGPT_MAX_PROMPT_LEN}, total <= {SHAREGPT_MAX_TOTAL_LEN})",
                              param="dataset_path", value=path)
    if len(requests) < num_prompts:
        rng = random.Random(seed)
        requests += [rng.choice(requests) for _ in range(num_prompts - len(requests))]
    return requests


def word_token_ids(tokenizer: Any) -> np.ndarray:
    """Ordinary word tokens: non-special ids in [WORD_TOKEN_LOW, tokenizer.vocab_size).

    Where the tokenizer has at least WORD_TOKEN_LOW ids among them that decode to a space and
    letters only (" house"), only those are kept: a text of such words tokenizes back to
    exactly as many tokens (it does with SmolLM2's tokenizer), so the lengths written to a
    file are the drawn ones. Otherwise (e.g. tokenizers that drop a lone token's leading space)
    every non-special id of the range is kept.
    """
    vocab = int(tokenizer.vocab_size)
    if vocab <= WORD_TOKEN_LOW:
        raise ValidationError(f"the tokenizer's vocabulary ({vocab}) is too small for synthetic text "
                              f"(ids from {WORD_TOKEN_LOW} up)", param="tokenizer", value=vocab)
    ids = np.arange(WORD_TOKEN_LOW, vocab)
    special = np.asarray(sorted(getattr(tokenizer, "all_special_ids", []) or []), dtype=np.int64)
    ids = ids[~np.isin(ids, special)]
    texts = tokenizer.batch_decode([[int(i)] for i in ids])
    words = ids[[bool(_SPACED_WORD.fullmatch(t)) for t in texts]]
    return words if len(words) >= WORD_TOKEN_LOW else ids


_SPACED_WORD = re.compile(r" [A-Za-z]+")


def write_sharegpt_file(path: str, name: str, num_prompts: int, seed: int, tokenizer: Any) -> dict[str, Any]:
    """Write a ShareGPT-format JSON of ``num_prompts`` conversations of a synthetic trace.

    For each (prompt_len, output_len) of :func:`synthetic_lengths` (``name`` = "sharegpt-like" or
    "alpaca-like", ``seed``), the human turn is the decoded text of prompt_len random word tokens
    (:func:`word_token_ids`, drawn from ``default_rng(seed)``) and the gpt turn that of output_len
    of them. Tokenizing the text again may give slightly different lengths with some tokenizers
    (pieces merge or split), and engines tokenize text themselves: that is why a comparison hands
    this one file to every engine. Returns a summary: drawn and re-tokenized mean lengths, and how
    many pairs pass :func:`is_valid_pair` (drawn prompts over 1024 tokens do not).
    """
    if num_prompts < 1:
        raise ValidationError.bad_value("num_prompts", num_prompts, ">= 1")
    lengths = synthetic_lengths(name, num_prompts, seed)
    words = word_token_ids(tokenizer)
    rng = np.random.default_rng(seed)
    data, retokenized = [], []
    for i, (prompt_len, output_len) in enumerate(lengths):
        human = tokenizer.decode(words[rng.integers(0, len(words), prompt_len)].tolist())
        gpt = tokenizer.decode(words[rng.integers(0, len(words), output_len)].tolist())
        data.append({"id": f"{name}-{seed}-{i}",
                     "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]})
        retokenized.append((len(tokenizer.encode(human)), len(tokenizer.encode(gpt))))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return {
        "path": path, "dataset_name": name, "seed": seed, "num_conversations": len(data),
        "mean_drawn_input_len": _mean(p for p, _ in lengths), "mean_drawn_output_len": _mean(o for _, o in lengths),
        "mean_input_len": _mean(p for p, _ in retokenized), "mean_output_len": _mean(o for _, o in retokenized),
        "num_valid": sum(is_valid_pair(p, o) for p, o in retokenized),
    }


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def summarize(requests: Sequence[BenchRequest]) -> tuple[float, float]:
    """Mean prompt and output lengths of a request list."""
    return _mean(r.prompt_len for r in requests), _mean(r.output_len for r in requests)


# --------------------------------------------------------------------------- CLI glue
def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    """The dataset options shared by ``bench throughput`` and ``bench serve`` (vLLM's names)."""
    parser.add_argument("--dataset-name", choices=DATASET_NAMES, default="random",
                        help="workload (random, sharegpt-like, alpaca-like, sharegpt; default: random)")
    parser.add_argument("--dataset-path", default=None,
                        help="ShareGPT JSON file (required for --dataset-name sharegpt)")
    parser.add_argument("--random-input-len", "--input-len", dest="random_input_len", type=int, default=128,
                        help="random: mean prompt tokens (default: 128)")
    parser.add_argument("--random-output-len", "--output-len", dest="random_output_len", type=int, default=128,
                        help="random: mean output tokens (default: 128)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="random: lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1 (default: 0)")
    parser.add_argument("--dataset-seed", type=int, default=None,
                        help="seed of the dataset only (default: --seed, as vLLM seeds its datasets)")


def dataset_seed(ns: argparse.Namespace) -> int:
    """--dataset-seed where given, else --seed (vLLM seeds engine and dataset with one --seed)."""
    return ns.seed if ns.dataset_seed is None else ns.dataset_seed


def check_dataset_args(ns: argparse.Namespace) -> None:
    """Refuse inconsistent dataset options before a model is loaded or a server is loaded."""
    if ns.dataset_name == "sharegpt" and not ns.dataset_path:
        raise ValidationError("--dataset-name sharegpt needs --dataset-path FILE", param="dataset_path")
    if ns.dataset_path and ns.dataset_name != "sharegpt":
        raise ValidationError(f"--dataset-path is read only with --dataset-name sharegpt, not {ns.dataset_name}",
                              param="dataset_path", value=ns.dataset_path)
    if ns.num_prompts < 1:
        raise ValidationError.bad_value("num_prompts", ns.num_prompts, ">= 1")
    if not 0.0 <= ns.random_range_ratio < 1.0:
        raise ValidationError.bad_value("random_range_ratio", ns.random_range_ratio, "in [0, 1)")


def requests_from_args(ns: argparse.Namespace, vocab_size: int, tokenizer: Any, seed: int,
                       max_total_len: int = SHAREGPT_MAX_TOTAL_LEN) -> list[BenchRequest]:
    """The ``ns.num_prompts`` requests of ``ns.dataset_name`` (options of :func:`add_dataset_args`).

    ``vocab_size`` bounds random token ids, ``tokenizer`` counts ShareGPT turns, and synthetic
    traces are clipped to ``max_total_len`` tokens per request.
    """
    if ns.dataset_name == "random":
        return random_requests(ns.num_prompts, ns.random_input_len, ns.random_output_len, vocab_size, seed,
                               ns.random_range_ratio)
    if ns.dataset_name in SYNTHETIC:
        return synthetic_requests(ns.dataset_name, ns.num_prompts, vocab_size, seed, max_total_len)
    return load_sharegpt(ns.dataset_path, ns.num_prompts, tokenizer, seed)
