"""The grammar cache counts what a compiled grammar measurably holds (xgrammar's estimate times a measured factor),
evicts the least recently used past its bound, and one grammar over the per-request budget is refused."""
from __future__ import annotations

from typing import Any

import pytest

from pagedllm.config import StructuredOutputsConfig
from pagedllm.errors import ValidationError
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.worker.structured_output import GRAMMAR_BYTES_PER_ESTIMATED, GrammarCache, GrammarCompiler


def test_the_cache_evicts_the_least_recently_used_past_its_bound() -> None:
    cache = GrammarCache(limit=100)
    cache.put(("regex", "a"), "A", 40)
    cache.put(("regex", "b"), "B", 40)
    assert cache.get(("regex", "a")) == "A"  # now the most recently used
    cache.put(("regex", "c"), "C", 40)
    assert cache.get(("regex", "b")) is None and cache.get(("regex", "a")) == "A" and cache.bytes == 80
    cache.put(("regex", "d"), "D", 101)  # over the whole bound: never kept, nothing evicted for it
    assert cache.get(("regex", "d")) is None and cache.bytes == 80


def test_a_budget_over_the_cache_is_refused_by_name() -> None:
    with pytest.raises(ValidationError) as e:
        StructuredOutputsConfig(grammar_cache_bytes=2 ** 20, max_grammar_bytes=2 ** 21)
    assert e.value.param == "max_grammar_memory"


def test_a_grammar_over_the_budget_is_refused_and_the_cache_counts_measured_bytes(tokenizer: Any) -> None:
    config = StructuredOutputsConfig(grammar_cache_bytes=64 * 2 ** 20, max_grammar_bytes=2 ** 20)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), config)
    small = compiler.compile(StructuredOutputsParams(regex="[a-z]{1,8}"))
    assert compiler.cached_bytes() == GRAMMAR_BYTES_PER_ESTIMATED * small.memory_size_bytes + len("[a-z]{1,8}")
    assert compiler.compile(StructuredOutputsParams(regex="[a-z]{1,8}")) is small  # from the cache
    big = "root ::= " + " ".join(f'"w{i:04d}" [a-z]*' for i in range(200))  # ~1.5 MB estimated
    with pytest.raises(ValidationError) as e:
        compiler.compile(StructuredOutputsParams(grammar=big))
    assert e.value.param == "structured_outputs.grammar" and "--max-grammar-memory" in str(e.value)


def test_a_refused_grammar_is_not_compiled_again(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repeat of a constraint refused as over the budget is refused at once: compiling it again would cost a
    client's repeats as much as the first (seconds of a core each)."""
    config = StructuredOutputsConfig(grammar_cache_bytes=64 * 2 ** 20, max_grammar_bytes=2 ** 20)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), config)
    compiles = []
    real = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda kind, text: compiles.append(kind) or real(kind, text))
    big = StructuredOutputsParams(grammar="root ::= " + " ".join(f'"w{i:04d}" [a-z]*' for i in range(200)))
    for _ in range(3):
        with pytest.raises(ValidationError) as e:
            compiler.compile(big)
        assert e.value.param == "structured_outputs.grammar" and "--max-grammar-memory" in str(e.value)
    assert compiles == ["grammar"]
    compiler.compile(StructuredOutputsParams(regex="[a-z]{1,8}"))  # others still compile
    assert compiles == ["grammar", "regex"]
