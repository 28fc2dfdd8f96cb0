"""xgrammar vs llguidance vs outlines-core on the default model's tokenizer: the numbers the choice of
structured-output library rests on (docs/BENCHMARKS.md, "Structured outputs").

For one nested JSON schema (20 variants, so nothing is served from a cache) each library's
one-time tokenizer set-up, its compile time, and its per-step cost along a valid reply (fill
the next-token mask, then accept the token), and whether it accepts that reply at all.

    .venv/bin/pip install llguidance outlines-core   # the two others (xgrammar is a dependency)
    .venv/bin/python benchmarks/grammar_libraries.py
"""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.engine.llm_engine import get_tokenizer

REPLY = '{"name": "Ada", "age": 36, "tags": ["red", "blue"], "address": {"city": "Paris", "zip": "75001"}, "ok": true}'


def schema(variant: int) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address", "ok"],
            "properties": {"name": {"type": "string", "maxLength": 20 + variant},
                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                           "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
                           "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                       "properties": {"city": {"type": "string"},
                                                      "zip": {"type": "string", "pattern": "[0-9]{5}"}}},
                           "ok": {"type": "boolean"}}}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Any, vocab: int) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, s: dict) -> Any:
        return self.compiler.compile_json_schema(json.dumps(s), any_whitespace=False)

    def start(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def step(self, m: Any, token: int) -> bool:
        m.fill_next_token_bitmask(self.mask, 0)
        return m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok)
        self.mask = llguidance.torch.allocate_token_bitmask(1, self.tok.vocab_size)

    def compile(self, s: dict) -> Any:
        # whitespace_flexible: its compact form has no spaces
        grammar = self.llg.LLMatcher.grammar_from_json_schema(s, defaults={"whitespace_flexible": True})
        return self.llg.LLMatcher(self.tok, grammar)  # llguidance builds lazily: the matcher is the compile

    def start(self, compiled: Any) -> Any:
        return compiled

    def step(self, m: Any, token: int) -> bool:
        self.llg.torch.fill_next_token_bitmask(m, self.mask, 0)
        return m.consume_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok: Any, vocab: int) -> None:
        import xgrammar as xgr
        from outlines_core import Guide, Index, Vocabulary, json_schema
        self.Guide, self.Index, self.json_schema = Guide, Index, json_schema
        # token bytes as xgrammar decodes them (outlines-core's own loader reads the model hub)
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        mapping: dict[bytes, list[int]] = {}
        for i, raw in enumerate(info.decoded_vocab):
            if raw and i != tok.eos_token_id and i not in info.special_token_ids:
                mapping.setdefault(raw, []).append(i)
        self.vocab = Vocabulary(tok.eos_token_id, mapping)
        self.mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def compile(self, s: dict) -> Any:
        return self.Index(self.json_schema.build_regex_from_schema(json.dumps(s), r"[ ]?"), self.vocab)

    def start(self, compiled: Any) -> Any:
        return self.Guide(compiled)

    def step(self, g: Any, token: int) -> bool:
        g.write_mask_into(self.mask.data_ptr(), self.mask.numel(), self.mask.element_size())
        g.advance(token)
        return True


def main() -> None:
    tok = get_tokenizer()
    vocab = len(tok)
    tokens = tok.encode(REPLY, add_special_tokens=False)
    print(f"reply: {len(tokens)} tokens; vocabulary {vocab}")
    print("| library | tokenizer set-up ms | compile ms (median of 20) | per step µs (mask + accept) "
          "| accepts the reply |")
    print("|---|---|---|---|---|")
    for cls in (XGrammar, LLGuidance, OutlinesCore):
        try:
            lib, setup = timed(lambda cls=cls: cls(tok, vocab))
        except ImportError as e:
            print(f"| {cls.name} | not installed ({e.name}) | | | |")
            continue
        compiles, compiled = [], None
        for v in range(20):
            compiled, seconds = timed(lambda lib=lib, v=v: lib.compile(schema(v)))
            compiles.append(seconds)
        steps, ok = [], True
        for _ in range(5):
            m = lib.start(lib.compile(schema(0)))
            for t in tokens:
                accepted, seconds = timed(lambda lib=lib, m=m, t=t: lib.step(m, t))
                steps.append(seconds)
                ok = ok and bool(accepted)
        print(f"| {lib.name} | {setup * 1e3:.0f} | {statistics.median(compiles) * 1e3:.2f} | "
              f"{statistics.median(steps) * 1e6:.1f} | {'yes' if ok else 'NO'} |")


if __name__ == "__main__":
    main()
