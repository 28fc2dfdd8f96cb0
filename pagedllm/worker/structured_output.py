"""Structured outputs through xgrammar: a grammar per constraint (compiled once, cached), a matcher
per constrained request, and each step one token bitmask for the constrained rows only.

The engine's processor compiles a request's constraint once, off the step loop, to refuse a bad
schema or regex before it is queued (400 naming the field); the worker finds it in the same cache
when it runs in the same process (one ``compiler_for`` per process), a worker process compiles it
again from its own (the compiled grammar does not cross the process seam). Each cache is ours, not
xgrammar's (whose cache kept ~8 MiB per distinct large schema past its own limit), bounded by the bytes a
grammar measurably holds (``grammar_cache_memory``), least recently used out; one grammar over
``max_grammar_memory`` is refused. The worker keeps one
matcher per request, fed every accepted token, so every rank masks the same tokens. A request
resumed after a recompute preemption gets a new matcher fed its output so far.

A reply that starts inside a reasoning section (``grammar_after_reasoning``, vLLM's structured outputs with a
reasoning parser) keeps its matcher asleep until the reasoning's end marker is in its output: no mask, no token
read, only the implicit end tokens the grammar cannot start with banned; from the token after the marker (from
an implicit end token on) the grammar masks and reads as it does from the first token otherwise.
"""
from __future__ import annotations

import collections
import ctypes
import functools
import hashlib
import json
import threading
from collections.abc import Callable, Collection
from typing import Any

import torch

from pagedllm.config import StructuredOutputsConfig
from pagedllm.errors import ValidationError
from pagedllm.sampling_params import StructuredOutputsParams


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValidationError("structured outputs need xgrammar: pip install xgrammar",
                              param="structured_outputs") from None
    return xgrammar


GRAMMAR_BYTES_PER_ESTIMATED = 4
"""Bytes a compiled grammar holds per byte of xgrammar's ``memory_size_bytes`` (which leaves out e.g. its rules'
strings), rounded up from the worst measured: RSS growth while N distinct grammars were held (xgrammar 0.2.9,
SmolLM2's 49k vocabulary) over their estimate was 1.0 for regexes and EBNF, 1.1-1.9 for JSON schemas of required
properties, 2.9-4.4 for 1,400 optional properties, 3.9-4.4 for enums and choices."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


REFUSED_KEPT = 4096
"""Constraints remembered as over --max-grammar-memory (32-byte digests): a repeat is refused without compiling."""


class GrammarCache:
    """Compiled grammars by constraint, least recently used out once their measured bytes pass ``limit``
    (thread-safe)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self._entries: collections.OrderedDict[tuple[str, str], tuple[Any, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str]) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: tuple[str, str], grammar: Any, cost: int) -> None:
        """Keep ``grammar`` (``cost`` bytes), evicting the least recently used past the limit."""
        evicted = []
        with self._lock:
            if key in self._entries or cost > self.limit:
                return
            self._entries[key] = (grammar, cost)
            self.bytes += cost
            while self.bytes > self.limit:
                evicted.append(self._entries.popitem(last=False)[1])
                self.bytes -= evicted[-1][1]
        if evicted:
            evicted.clear()  # freed here, outside the lock
            trim = _malloc_trim()
            if trim is not None:  # glibc keeps the freed pages: 8 dropped grammars kept +64 MiB RSS, trimmed +0
                trim(0)


DEFAULT_CONFIG = StructuredOutputsConfig()
"""structured_outputs_config's defaults (frozen: one shared instance)."""


def _control_tokens(decoded_vocab: list[bytes], stops: set[int]) -> torch.Tensor:
    """The ids whose bytes hold a control character (below 0x20), stop tokens aside."""
    return torch.tensor([i for i, b in enumerate(decoded_vocab) if i not in stops and any(byte < 0x20 for byte in b)],
                        dtype=torch.long)


class GrammarCompiler:
    """One tokenizer's compiler and its cache of compiled grammars (at most ``config.grammar_cache_bytes`` as
    measured, least recently used out; thread-safe)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 config: StructuredOutputsConfig = DEFAULT_CONFIG) -> None:
        xgr = _xgrammar()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids) or None)
        # one thread: a heavy grammar takes one core, never the step's share of the others; xgrammar's own
        # cache off: past its limit it still grew ~8 MiB per distinct 1,400-property schema (+546 MiB after 60
        # at a 64 MiB limit, 359 MiB still held after clear_cache and malloc_trim)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.cache = GrammarCache(config.grammar_cache_bytes)
        self._refused: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        """Digests of constraints refused as over max_grammar_bytes, with their measured cost (newest kept)."""
        self._lock = threading.Lock()
        self.cache_bytes = config.grammar_cache_bytes
        self.max_grammar_bytes = config.max_grammar_bytes
        self.vocab_size = vocab_size
        self.control_token_ids = _control_tokens(self.info.decoded_vocab[:vocab_size], set(stop_token_ids))
        """Tokens banned under a JSON constraint: JSON forbids raw control characters (RFC 8259), xgrammar's
        string rule lets them through, and compact JSON needs none outside strings."""

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``spec`` (from the cache when it is there); a bad schema, regex or grammar, or
        one whose compiled form would hold over ``max_grammar_bytes``, raises ValidationError naming
        ``structured_outputs.<kind>``."""
        kind = spec.kind
        try:
            text = _source(spec)
            grammar = self.cache.get((kind, text))
            if grammar is not None:
                return grammar
            digest = hashlib.sha256(f"{kind}\0{text}".encode("utf-8", "surrogatepass")).digest()
            cost = self._refused.get(digest)
            if cost is None:  # (a grammar refused before is not compiled again: a repeat would cost as much)
                grammar = self._compile(kind, text)
                cost = grammar_bytes(grammar) + len(text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValidationError(f"structured_outputs.{kind} does not compile: {e}".split("\n")[0][:500],
                                  param=f"structured_outputs.{kind}") from None
        if cost > self.max_grammar_bytes:
            with self._lock:
                self._refused[digest] = cost
                while len(self._refused) > REFUSED_KEPT:
                    self._refused.popitem(last=False)
            raise ValidationError(f"structured_outputs.{kind} compiles to a grammar of ~{cost >> 20} MiB; this server "
                                  f"compiles at most {self.max_grammar_bytes >> 20} MiB for one request "
                                  "(--max-grammar-memory)", param=f"structured_outputs.{kind}", value=cost)
        self.cache.put((kind, text), grammar, cost)
        return grammar

    def _compile(self, kind: str, text: str) -> Any:
        # JSON without free whitespace between tokens (one space after ':' and ','): a model cannot
        # pad its reply with newlines until max_tokens runs out
        if kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "json":
            return self.compiler.compile_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(text)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_grammar(json.loads(text)))
        return self.compiler.compile_grammar(text)

    def cached_bytes(self) -> int:
        """Bytes the cache holds now, as measured (at most ``cache_bytes``)."""
        return self.cache.bytes

    def matcher(self, spec: StructuredOutputsParams, accepted: list[int], reasoning_ends: list[list[int]] | None = None,
                implicit_ends: Collection[int] = ()) -> Matcher:
        """A matcher at the start of ``spec``'s grammar, fed ``accepted`` (a resumed request's output).
        ``reasoning_ends``: the reply starts inside its reasoning, which any of these markers ends (or a token of
        ``implicit_ends``, the grammar's first): the matcher sleeps until then (see ``Matcher.readable``)."""
        matcher = Matcher(_xgrammar().GrammarMatcher(self.compile(spec)),
                          self.control_token_ids if spec.kind in ("json", "json_object") else None,
                          reasoning_ends, implicit_ends)
        for token in matcher.readable(accepted, len(accepted)):
            matcher.accept_token(token)
        return matcher


class Matcher:
    """xgrammar's matcher of one request, plus tokens banned on top of its grammar, and whether it still sleeps
    through the reply's reasoning."""

    def __init__(self, matcher: Any, banned: torch.Tensor | None, reasoning_ends: list[list[int]] | None = None,
                 implicit_ends: Collection[int] = ()) -> None:
        self.matcher = matcher
        self.banned = banned
        self.reasoning_ends = [list(end) for end in reasoning_ends or () if end]
        """The markers that end the reply's reasoning (the grammar reads what follows)."""
        self.implicit_ends = frozenset(implicit_ends) if self.reasoning_ends else frozenset()
        """Tokens that end the reasoning and are the grammar's first."""
        self.reasoning = bool(self.reasoning_ends)
        """Asleep: the reply is still in its reasoning (no mask, no token read)."""
        refused = [t for t in sorted(self.implicit_ends) if not self._allows(t)]
        self.reasoning_banned = torch.tensor(refused, dtype=torch.long) if refused else None
        """While the reasoning lasts: the implicit ends the grammar cannot start with (as vLLM masks them)."""

    def _allows(self, token: int) -> bool:
        """Whether the grammar, as it stands, accepts ``token`` next (tried, then undone)."""
        try:
            if not self.matcher.accept_token(token):
                return False
        except Exception:  # (an id outside the vocabulary: never sampled anyway)
            return False
        self.matcher.rollback(1)
        return True

    def readable(self, output: list[int], new: int) -> list[int]:
        """Of ``output``'s last ``new`` tokens, those the grammar reads: all once the reasoning has ended; while it
        lasts, the ones after its end (from an implicit end token on) if it ends among them, which wakes the
        matcher, else none."""
        if not self.reasoning:
            return output[len(output) - new:]
        end = reasoning_end(output, self.reasoning_ends, self.implicit_ends, len(output) - new)
        if end is None:
            return []
        self.reasoning = False
        return output[end[0]:]

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


def reasoning_end(tokens: list[int], ends: list[list[int]], implicit: Collection[int] = (),
                  since: int = 0) -> tuple[int, int] | None:
    """Where the reasoning a reply's output ``tokens`` starts in ends, looking only at tokens[since:] (a marker
    may begin before ``since``): (the index of the first token the grammar reads, of the first token it masks).
    The first of: a marker of ``ends`` wholly in ``tokens`` (both are the token after it), or a token of
    ``implicit`` (the grammar reads it, and masks from the next). None: the reasoning has not ended."""
    for i in range(max(since, 0), len(tokens)):
        if tokens[i] in implicit:
            return i, i + 1
        for end in ends:
            if len(end) <= i + 1 and tokens[i + 1 - len(end):i + 1] == end:
                return i + 1, i + 1
    return None


def grammar_bytes(grammar: Any) -> int:
    """Bytes a compiled grammar holds, as measured (see GRAMMAR_BYTES_PER_ESTIMATED)."""
    return GRAMMAR_BYTES_PER_ESTIMATED * grammar.memory_size_bytes


def _source(spec: StructuredOutputsParams) -> str:
    """The constraint's text: what it is compiled from, and its key in the cache."""
    value = getattr(spec, spec.kind)
    if spec.kind == "json_object":
        return ""
    if spec.kind == "choice" or (spec.kind == "json" and not isinstance(value, str)):
        return json.dumps(value)
    return value


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


@functools.lru_cache(maxsize=4)
def compiler_for(model_path: str, vocab_size: int, stop_token_ids: tuple[int, ...],
                 config: StructuredOutputsConfig = DEFAULT_CONFIG) -> GrammarCompiler:
    """The compiler of a model's tokenizer, one per process (the engine's processor and an in-process worker
    share it, and so its cache); built on first use: most engines never need it."""
    from pagedllm.models.loader import tokenizer_of

    return GrammarCompiler(tokenizer_of(model_path), vocab_size, stop_token_ids, config)


def apply_draft_masks(logits: torch.Tensor, groups: list[tuple[int, Any, list[int], list[int]]]
                      ) -> tuple[torch.Tensor, list[int]]:
    """Speculative decoding: each group (first row, matcher, drafts, output so far) owns rows first .. first +
    len(drafts), row j scoring the token after drafts[:j]. Each row is masked as the grammar stands after those
    drafts (fed ahead, then rolled back). Returns float32 logits and, per group, how many drafts the grammar allows
    (the rows past the first draft it refuses are never used: that draft is rejected). A matcher asleep in the
    reply's reasoning leaves the rows before the reasoning's end unmasked (but for its banned implicit ends) and
    reads only the drafts after it (``reasoning_end`` over the output and the drafts: a row whose drafts cross
    the end marker is masked exactly as the step after it will be)."""
    xgr = _xgrammar()
    logits = logits.float() if logits.dtype != torch.float32 else logits
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # (rows, ceil(vocab / 32)) int32
    bitmask.fill_(-1)  # all allowed: rows without a live grammar stay as they are
    banned: list[tuple[int, torch.Tensor]] = []
    allowed_drafts = []
    for first, matcher, drafts, output in groups:
        read_from, mask_from = 0, 0
        if getattr(matcher, "reasoning", False):
            end = reasoning_end(output + drafts, matcher.reasoning_ends, matcher.implicit_ends, len(output))
            read_from, mask_from = (len(drafts) + 1,) * 2 if end is None else \
                (end[0] - len(output), end[1] - len(output))
            if matcher.reasoning_banned is not None:
                banned += [(first + j, matcher.reasoning_banned) for j in range(min(mask_from, len(drafts) + 1))]
        fed = 0
        for j in range(read_from, len(drafts) + 1):
            if matcher.is_terminated():
                break
            if j >= mask_from:
                matcher.fill_next_token_bitmask(bitmask, first + j)
                if matcher.banned is not None:
                    banned.append((first + j, matcher.banned))
            if j == len(drafts) or not matcher.accept_token(drafts[j]):
                break
            fed += 1
        matcher.rollback(fed)
        allowed_drafts.append(min(read_from + fed, len(drafts)))
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
    for row, tokens in banned:
        logits[row, tokens.to(logits.device)] = float("-inf")
    return logits, allowed_drafts


def apply_masks(logits: torch.Tensor, matchers: dict[int, Any]) -> torch.Tensor:
    """Mask (-inf) in ``logits`` (rows, vocab) every token the matcher of each constrained row
    forbids; rows without a matcher, and finished grammars, are left alone. Returns float32 logits."""
    asleep = [(row, m.reasoning_banned) for row, m in matchers.items() if getattr(m, "reasoning", False)]
    for row, tokens in asleep:  # in the reply's reasoning: only the implicit ends the grammar refuses are banned
        if tokens is not None:
            logits[row, tokens.to(logits.device)] = float("-inf")
    live = {row: m for row, m in matchers.items() if not getattr(m, "reasoning", False) and not m.is_terminated()}
    return _apply_live_masks(logits, live) if live else logits


def _apply_live_masks(logits: torch.Tensor, live: dict[int, Any]) -> torch.Tensor:
    """apply_masks for the rows whose grammar is live: one bitmask for them all, then each one's banned tokens."""
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
