"""What one request may ask of the server, checked at the edge before anything is allocated for it.

Every size a client controls is bounded here (each bound a ``pagedllm serve`` flag): a request over a
bound is a 400 naming the field, before tokenizing, before a sequence id or an output state exists,
and before the engine hears of it. The bounds allow every ordinary request many times over; they
exist so that one request cannot make the server spend seconds or gigabytes preparing it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import typing
from typing import Any

from pagedllm.engine.processor import MAX_LOGPROBS
from pagedllm.entrypoints.cli_args import field_docs
from pagedllm.errors import ValidationError
from pagedllm.sampling_params import StructuredOutputsParams, check_refs

BYTES_PER_TOKEN_CAP = 64
"""Default prompt cap: 64 bytes of text per token of max_model_len (English averages ~4 bytes per token, so a
prompt over the cap could only fit the model's context in a pathological tokenization)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingLimits:
    """What the server refuses before it costs the engine anything (``pagedllm serve`` options)."""

    max_waiting_requests: int | None = None
    """More requests than this waiting to be scheduled (new, or preempted back to the queue): new ones get 503
    with Retry-After (None: no limit)."""
    request_timeout: float | None = None
    """Seconds a request may take from its arrival (its preparation included) to its last token; then it is
    aborted (504, or an error event on a stream). None: no limit."""
    max_prompt_bytes: int | None = None
    """UTF-8 bytes of prompt text (a completion's prompts, a chat's messages, /tokenize) checked before
    tokenizing (400). None: BYTES_PER_TOKEN_CAP per token of max_model_len."""
    max_n: int | None = None
    """Most samples (n, best_of, beams) of one prompt. None: the engine's max_num_seqs (no more can run at once)."""
    max_prompts: int = 1024
    """Most prompts in one completion request, and most samples (prompts times n) in one request."""
    max_stop_strings: int = 64
    """Most stop strings in one request."""
    max_bad_words: int = 256
    """Most bad_words in one request."""
    max_word_bytes: int = 1024
    """Most UTF-8 bytes of one stop string or one bad word."""
    max_logit_bias: int = 1024
    """Most logit_bias entries (and allowed_token_ids, stop_token_ids) in one request."""
    max_tools: int = 128
    """Most tools in one chat request (OpenAI's own bound)."""
    max_tools_bytes: int = 256 * 1024
    """Most bytes of one chat request's tools, as JSON."""
    max_choices: int = 1024
    """Most strings in one structured-output choice."""
    max_schema_bytes: int = 64 * 1024
    """Most bytes of one structured-output constraint: a JSON schema (as JSON), a regex, a grammar, or all
    choice strings together."""
    max_schema_depth: int = 64
    """Deepest nesting of objects and arrays in one JSON schema (a response_format's, structured_outputs', or the
    one tool_choice makes of the tools)."""
    max_json_values: int = 2**18
    """Most JSON values (arrays, objects and their entries) in one request body, counted on its raw bytes before
    it is parsed (parsing holds the event loop in proportion to them: ~1-4 us each here). OpenAI's own largest
    request, 300k tokens of embeddings input as token ids, needs a little more: raise it for those."""
    max_json_depth: int = 128
    """Deepest nesting of arrays and objects in one request body (room for a schema at --max-schema-depth
    inside its request)."""
    max_request_tokens: int | None = None
    """Most tokens one request may generate in all (prompts x n, or beams, x max_tokens; an omitted max_tokens
    counts as the rest of the context), and most entries a non-streamed reply holds (each token with its logprobs
    alternatives, and prompt_logprobs'): a stream holds nothing per token, a whole reply all of it. None: 2**20, or
    one whole context with the most logprobs a token when that is more (any single sample is served, as vLLM)."""

    max_logprobs: int = MAX_LOGPROBS
    """Not a flag of its own: the engine's max_logprobs (--max-logprobs, -1 resolved to the vocabulary size), set
    by the server from the engine's config. It sizes the default max_request_tokens, and a request's -1
    ("every token") counts as this many alternatives per token."""

    max_stored_responses: int = 1000
    """Most responses kept for GET /v1/responses/{id} and previous_response_id (``store: true``); with K API keys,
    each key's share is a Kth and its own least recently used goes first."""
    max_stored_response_bytes: int = 64 * 1024 * 1024
    """Most bytes held by all stored responses together (compressed JSON, conversations included, plus each
    entry's own objects); with K API keys, each key's share is a Kth and its own least recently used goes first."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            zero_ok = field.name in _FROM_ENGINE  # (--max-logprobs 0: no alternatives, as vLLM)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or value < 0 or (value == 0 and not zero_ok)):
                raise ValidationError.bad_value(field.name, value, "an integer >= 0" if zero_ok else "a number above 0")


def check_count(items: Any, limit: int, param: str, flag: str) -> None:
    """400 naming ``param`` when ``items`` (a list or dict) has more than ``limit`` entries."""
    if items is not None and not isinstance(items, str) and len(items) > limit:
        raise ValidationError(f"{param} has {len(items)} entries; this server takes at most {limit} ({flag})",
                              param=param, value=len(items))


def check_words(words: Any, limits: ServingLimits, param: str, flag: str, count: int) -> None:
    """A list of strings (stop, bad_words): at most ``count`` of them, each at most max_word_bytes."""
    if words is None:
        return
    words = [words] if isinstance(words, str) else words
    check_count(words, count, param, flag)
    for i, word in enumerate(words):
        size = len(word.encode("utf-8", "surrogatepass")) if isinstance(word, str) else 0
        if size > limits.max_word_bytes:
            raise ValidationError(f"{param}[{i}] is {size} bytes; this server takes at most {limits.max_word_bytes} "
                                  "(--max-word-bytes)", param=f"{param}[{i}]", value=size)


def check_sampling_limits(req: Any, limits: ServingLimits, max_num_seqs: int) -> None:
    """The bounds every generation request shares (n, stop strings, bad words, logit_bias, token lists)."""
    max_n = limits.max_n or max_num_seqs
    for name in ("n", "best_of"):
        value = getattr(req, name, None)
        if isinstance(value, int) and value > max_n:
            flag = "--max-n" if limits.max_n else "the engine's max_num_seqs; see --max-n"
            raise ValidationError(f"{name} is {value}; this server runs at most {max_n} samples of a prompt "
                                  f"({flag})", param=name, value=value)
    check_words(req.stop, limits, "stop", "--max-stop-strings", limits.max_stop_strings)
    check_words(req.bad_words, limits, "bad_words", "--max-bad-words", limits.max_bad_words)
    for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
        check_count(getattr(req, name), limits.max_logit_bias, name, "--max-logit-bias")


def check_samples(num_prompts: int, n: int, limits: ServingLimits) -> None:
    """A completion's prompts times its samples each within max_prompts (each sample is a sequence to run)."""
    if num_prompts * n > limits.max_prompts:
        raise ValidationError(f"{num_prompts} prompts x n {n} is {num_prompts * n} samples; this server runs at most "
                              f"{limits.max_prompts} in one request (--max-prompts)", param="n", value=n)


REQUEST_TOKENS_FLOOR = 2**20
"""The default --max-request-tokens on a model whose context is short (see ServingLimits.max_request_tokens)."""


def request_tokens_cap(limits: ServingLimits, max_model_len: int) -> int:
    """--max-request-tokens, or its default: 2**20, or one sample filling the context with the most logprobs a
    token (1 + the engine's max_logprobs entries each), whichever is more: a single ordinary sample is never
    refused, and the largest reply stays what --max-logprobs allows."""
    if limits.max_request_tokens is not None:
        return limits.max_request_tokens
    return max(REQUEST_TOKENS_FLOOR, (1 + limits.max_logprobs) * max_model_len)


def check_request_tokens(limits: ServingLimits, max_model_len: int, max_tokens: list[int], n: int, stream: bool,
                         logprobs: int | None = None, prompt_tokens: list[int] | None = None,
                         prompt_logprobs: int | None = None, names: tuple[str, str] = ("max_tokens", "logprobs")
                         ) -> None:
    """The product of a request's bounds within max_request_tokens (400 naming the field), before it is queued:
    the tokens it may generate (``max_tokens``: each prompt's, an omitted one already filled to the context, times
    ``n`` samples or beams), and unless it streams, what its reply would hold: each token with its ``logprobs``
    alternatives, and each prompt token with its ``prompt_logprobs`` ones (in each of the n choices). ``names``:
    the request's own names for max_tokens and logprobs; a -1 (vLLM's "every token") counts as the engine's
    max_logprobs, all it can be (the engine refuses it when the vocabulary is larger)."""
    limit = request_tokens_cap(limits, max_model_len)
    logprobs, prompt_logprobs = (limits.max_logprobs if value == -1 else value for value in (logprobs, prompt_logprobs))
    generated = n * sum(max_tokens)
    if generated > limit:
        raise ValidationError(f"this request may generate {generated} tokens ({len(max_tokens)} prompt(s) x n {n} x "
                              f"{names[0]} {max(max_tokens)}, an omitted {names[0]} counting as the rest of the "
                              f"context); this server generates at most {limit} in one request "
                              "(--max-request-tokens)", param=names[0], value=generated)
    if stream:
        return  # a stream holds nothing per token
    scored = 0 if prompt_logprobs is None else n * sum(prompt_tokens or ()) * (1 + prompt_logprobs)
    entries = generated * (1 + (logprobs or 0)) + scored
    if entries > limit:
        param = names[1] if logprobs else "prompt_logprobs" if prompt_logprobs is not None else names[0]
        raise ValidationError(f"this request's reply would hold {entries} tokens and log-probabilities ({generated} "
                              f"tokens x (1 + {names[1]} {logprobs or 0}) + {scored} of prompt_logprobs); this server "
                              f"holds at most {limit} for one reply (--max-request-tokens): stream it, or ask for "
                              "fewer", param=param, value=entries)


def check_tools(tools: list[dict] | None, limits: ServingLimits) -> None:
    """A chat request's tools: at most max_tools, at most max_tools_bytes of JSON."""
    if tools is None:
        return
    check_count(tools, limits.max_tools, "tools", "--max-tools")
    size = len(json.dumps(tools, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > limits.max_tools_bytes:
        raise ValidationError(f"tools are {size} bytes of JSON; this server takes at most {limits.max_tools_bytes} "
                              "(--max-tools-bytes)", param="tools", value=size)


def json_depth(value: Any) -> int:
    """How deep objects and arrays nest in parsed JSON (a scalar: 0); iterative, for any depth."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_constraint(spec: StructuredOutputsParams | None, limits: ServingLimits, param: str,
                     count_bytes: bool = True) -> None:
    """A structured-output constraint within max_choices, max_schema_bytes (unless ``count_bytes`` is off: the
    tools' own cap stands) and max_schema_depth, before it is compiled; ``param`` names where it came from."""
    if spec is None:
        return
    kind = spec.kind
    value = getattr(spec, kind)
    if kind == "choice":
        check_count(value, limits.max_choices, param, "--max-choices")
    if kind == "json_object":
        return
    size = (sum(len(c.encode("utf-8", "surrogatepass")) for c in value) if kind == "choice" else
            len((value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                .encode("utf-8", "surrogatepass")))
    if count_bytes and size > limits.max_schema_bytes:
        raise ValidationError(f"{param} is {size} bytes; this server compiles at most {limits.max_schema_bytes} "
                              "(--max-schema-bytes)", param=param, value=size)
    if kind == "json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
            depth = json_depth(schema)
        except RecursionError:  # deeper than Python parses: over any limit
            depth = math.inf
        except ValueError:
            return  # not JSON: the compiler's own error names it
        if depth > limits.max_schema_depth:
            raise ValidationError(f"{param} nests {depth} levels deep; this server compiles at most "
                                  f"{limits.max_schema_depth} (--max-schema-depth)", param=param, value=depth)
        check_refs(schema, param)  # (the engine's processor checks again: offline requests too)


_FLAGGED_ELSEWHERE = ("max_waiting_requests", "request_timeout", "max_prompt_bytes")
"""ServingLimits fields whose flags api_server defines itself (with their own wording)."""
_FROM_ENGINE = ("max_logprobs",)
"""ServingLimits fields the server takes from the engine's config (their flags are engine options)."""


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """One ``pagedllm serve`` flag per remaining ServingLimits field (``--max-stop-strings``), typed and described
    by the field, as the engine's flags are."""
    hints, docs = typing.get_type_hints(ServingLimits), field_docs(ServingLimits)
    group = parser.add_argument_group("request limits (a request over one is refused with 400 naming the field)")
    for f in dataclasses.fields(ServingLimits):
        if f.name in _FLAGGED_ELSEWHERE or f.name in _FROM_ENGINE:
            continue
        kind = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind[0], default=f.default,
                           metavar="N", help=f"{docs.get(f.name, '')} (default: {f.default})".replace("%", "%%"))


def serving_limits(ns: argparse.Namespace) -> ServingLimits:
    """The limits a parsed ``pagedllm serve`` command line sets (ValidationError naming a bad one)."""
    return ServingLimits(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(ServingLimits)
                            if f.name not in _FROM_ENGINE})
