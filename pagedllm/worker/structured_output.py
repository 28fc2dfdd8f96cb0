"""Structured outputs through xgrammar: a grammar per constraint (compiled once, cached), a matcher
per constrained request, and each step one token bitmask for the constrained rows only.

The engine's processor compiles a request's constraint once, off the step loop, to refuse a bad
schema or regex before it is queued (400 naming the field); the worker finds it in the same cache
when it runs in the same process (one ``compiler_for`` per process), a worker process compiles it
again from its own (the compiled grammar does not cross the process seam). Each cache is xgrammar's
own, bounded in bytes (``grammar_cache_memory``), least recently used out. The worker keeps one
matcher per request, fed every accepted token, so every rank masks the same tokens. A request
resumed after a recompute preemption gets a new matcher fed its output so far.
"""
from __future__ import annotations

import functools
import json
from typing import Any

import torch

from pagedllm.config import DEFAULT_GRAMMAR_CACHE_BYTES
from pagedllm.errors import ValidationError
from pagedllm.sampling_params import StructuredOutputsParams


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValidationError("structured outputs need xgrammar: pip install xgrammar",
                              param="structured_outputs") from None
    return xgrammar


class GrammarCompiler:
    """One tokenizer's compiler and its cache of compiled grammars (at most ``cache_bytes``, least recently
    used out; thread-safe)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES) -> None:
        xgr = _xgrammar()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        # one thread: a heavy grammar takes one core, never the step's share of the others
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True,
                                            cache_limit_bytes=cache_bytes)
        self.cache_bytes = cache_bytes
        self.vocab_size = vocab_size
        # JSON forbids raw control characters (RFC 8259), xgrammar's string rule lets them through, and
        # compact JSON needs none outside strings: tokens holding one are banned under a JSON constraint
        stops = set(stop_token_ids)
        self.control_token_ids = torch.tensor(
            [i for i, b in enumerate(self.info.decoded_vocab[:vocab_size])
             if i not in stops and any(byte < 0x20 for byte in b)], dtype=torch.long)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec`` (from the cache when it is there); a bad schema, regex or grammar
        raises ValidationError naming ``structured_outputs.<kind>``."""
        kind = spec.kind
        try:
            # JSON without free whitespace between tokens (one space after ':' and ','): a model cannot
            # pad its reply with newlines until max_tokens runs out
            if kind == "json_object":
                grammar = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "json":
                grammar = self.compiler.compile_json_schema(spec.json if isinstance(spec.json, str)
                                                            else json.dumps(spec.json), any_whitespace=False)
            elif kind == "regex":
                grammar = self.compiler.compile_regex(spec.regex)
            elif kind == "choice":
                grammar = self.compiler.compile_grammar(choice_grammar(spec.choice))
            else:
                grammar = self.compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValidationError(f"structured_outputs.{kind} does not compile: {e}".split("\n")[0][:500],
                                  param=f"structured_outputs.{kind}") from None
        return grammar

    def cached_bytes(self) -> int:
        """Bytes the cache holds now (at most about ``cache_bytes``)."""
        return self.compiler.get_cache_size_bytes()

    def matcher(self, spec: StructuredOutputsParams, accepted: list[int]) -> "Matcher":
        """A matcher at the start of ``spec``'s grammar, fed ``accepted`` (a resumed request's output)."""
        matcher = Matcher(_xgrammar().GrammarMatcher(self.compile(spec)),
                          self.control_token_ids if spec.kind in ("json", "json_object") else None)
        for token in accepted:
            matcher.accept_token(token)
        return matcher


class Matcher:
    """xgrammar's matcher of one request, plus tokens banned on top of its grammar."""

    def __init__(self, matcher: Any, banned: torch.Tensor | None) -> None:
        self.matcher = matcher
        self.banned = banned

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (draft tokens checked ahead of verification)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


@functools.lru_cache(maxsize=4)
def compiler_for(model_path: str, vocab_size: int, stop_token_ids: tuple[int, ...],
                 cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES) -> GrammarCompiler:
    """The compiler of a model's tokenizer, one per process (the engine's processor and an in-process worker
    share it, and so its cache); built on first use: most engines never need it."""
    from pagedllm.models.loader import load_tokenizer
    return GrammarCompiler(load_tokenizer(model_path), vocab_size, stop_token_ids, cache_bytes)


def apply_draft_masks(logits: torch.Tensor, groups: list[tuple[int, Any, list[int]]]) -> tuple[torch.Tensor, list[int]]:
    """Speculative decoding: each group (first row, matcher, drafts) owns rows first .. first + len(drafts),
    row j scoring the token after drafts[:j]. Each row is masked as the grammar stands after those drafts
    (fed ahead, then rolled back). Returns float32 logits and, per group, how many drafts the grammar allows
    (the rows past the first draft it refuses are never used: that draft is rejected)."""
    xgr = _xgrammar()
    logits = logits.float() if logits.dtype != torch.float32 else logits
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # (rows, ceil(vocab / 32)) int32
    bitmask.fill_(-1)  # all allowed: rows without a live grammar stay as they are
    banned: list[tuple[int, torch.Tensor]] = []
    allowed_drafts = []
    for first, matcher, drafts in groups:
        fed = 0
        for j in range(len(drafts) + 1):
            if matcher.is_terminated():
                break
            matcher.fill_next_token_bitmask(bitmask, first + j)
            if matcher.banned is not None:
                banned.append((first + j, matcher.banned))
            if j == len(drafts) or not matcher.accept_token(drafts[j]):
                break
            fed += 1
        matcher.rollback(fed)
        allowed_drafts.append(fed)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
    for row, tokens in banned:
        logits[row, tokens.to(logits.device)] = float("-inf")
    return logits, allowed_drafts


def apply_masks(logits: torch.Tensor, matchers: dict[int, Any]) -> torch.Tensor:
    """Mask (-inf) in ``logits`` (rows, vocab) every token the matcher of each constrained row
    forbids; rows without a matcher, and finished grammars, are left alone. Returns float32 logits."""
    live = {row: m for row, m in matchers.items() if not m.is_terminated()}
    if not live:
        return logits
    xgr = _xgrammar()
    logits = logits.float() if logits.dtype != torch.float32 else logits
    rows = sorted(live)
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])  # (rows, ceil(vocab / 32)) int32
    for i, row in enumerate(rows):
        live[row].fill_next_token_bitmask(bitmask, i)
    picked = logits[rows]  # (constrained rows, vocab): a copy; masked, then written back
    xgr.apply_token_bitmask_inplace(picked, bitmask.to(picked.device))
    for i, row in enumerate(rows):
        if live[row].banned is not None:
            picked[i, live[row].banned.to(picked.device)] = float("-inf")
    logits[rows] = picked
    return logits
