"""The configs of optional features: LoRA adapters, speculative decoding, structured outputs' grammar memory,
text watermarking.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedllm.config.values import json_object
from pagedllm.errors import ValidationError


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """LoRA adapters over the base model (present only with enable_lora)."""

    max_loras: int = 1
    """Adapters in one step (each has a slot of stacked weights in every LoRA layer)."""
    max_lora_rank: int = 16
    """Largest adapter rank (slots are this wide; smaller ranks are zero-padded)."""
    max_cpu_loras: int | None = None
    """Adapters kept read in host memory (least recently used dropped, read again when asked); None: max_loras."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValidationError.bad_value(name, value, "a positive integer")
        cpu = self.max_cpu_loras
        if cpu is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras:
            raise ValidationError.bad_value("max_cpu_loras", cpu, f"an integer >= max_loras ({self.max_loras})")


SPEC_METHODS = ("ngram", "suffix", "draft_model")
"""speculative_config methods: prompt lookup, suffix decoding, and a smaller draft model."""
MAX_SPEC_TOKENS = 32
"""Most draft tokens verified per sequence and step (a bound on what one config can ask of a step)."""


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValidationError.bad_value(f"speculative_config.{name}", value, "a positive integer")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` keys): a proposer drafts tokens, the model verifies
    them all in one forward and keeps the longest prefix it would have produced itself (exact: greedy output
    unchanged, sampled output in the model's distribution)."""

    method: str = "ngram"
    """"ngram" (prompt lookup over the prompt and output), "suffix" (suffix decoding over the request and
    earlier responses) or "draft_model" (a smaller checkpoint with the same tokenizer; implied by ``model``)."""
    num_speculative_tokens: int = 5
    """Most draft tokens per sequence and step (suffix: up to this many, adapted to the match)."""
    prompt_lookup_min: int = 5
    """ngram: shortest suffix of the context looked up earlier in it."""
    prompt_lookup_max: int = 5
    """ngram: longest suffix looked up (tried first)."""
    model: str | None = None
    """draft_model: the draft's HF folder or .gguf file (its vocabulary must be the target's)."""
    draft_tensor_parallel_size: int = 1
    """draft_model: ranks of the draft (1: it runs whole)."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: the longest context suffix matched."""
    suffix_decoding_max_cached_requests: int = 10000
    """suffix: earlier responses kept for matching (0: only the request's own tokens)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: at most this many draft tokens per matched token."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: a continuation token is proposed only while its frequency after the match is at least this."""
    disable_by_batch_size: int | None = 4
    """No speculation in a step with more decoding sequences than this: a larger batch is no longer bound by
    reading the weights, so verifying drafts costs their full price (measured on 2 cores with AVX-512, a copy-heavy
    task: 1.31x at 1 sequence, 1.16x at 2, 0.99x at 4, 0.85x at 16; docs/BENCHMARKS.md); None: every batch size."""
    min_acceptance_rate: float = 0.2
    """A sequence whose drafts are accepted less often than this (moving average) stops speculating for a
    while (its back-off doubles each time it fails again); 0: never back off."""

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValidationError.bad_value("speculative_config.method", self.method,
                                            " or ".join(repr(m) for m in SPEC_METHODS))
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPEC_TOKENS:
            raise ValidationError.bad_value("speculative_config.num_speculative_tokens", self.num_speculative_tokens,
                                            f"at most {MAX_SPEC_TOKENS}")
        for name in ("prompt_lookup_min", "prompt_lookup_max", "suffix_decoding_max_tree_depth",
                     "draft_tensor_parallel_size"):
            _positive_int(name, getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValidationError.bad_value("speculative_config.prompt_lookup_min", self.prompt_lookup_min,
                                            f"<= prompt_lookup_max ({self.prompt_lookup_max})")
        cached = self.suffix_decoding_max_cached_requests
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValidationError.bad_value("speculative_config.suffix_decoding_max_cached_requests", cached,
                                            "an integer >= 0")
        for name, low, high in (("suffix_decoding_max_spec_factor", 0.0, 1e6),
                                ("suffix_decoding_min_token_prob", 0.0, 1.0), ("min_acceptance_rate", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValidationError.bad_value(f"speculative_config.{name}", value, f"a number in [{low}, {high}]")
        if self.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if self.method == "draft_model" and self.model is None:
            raise ValidationError("speculative_config method 'draft_model' needs 'model' (the draft checkpoint)",
                                  param="speculative_config.model", value=None)
        if self.method != "draft_model" and self.model is not None:
            raise ValidationError.bad_value("speculative_config.model", self.model,
                                            f"absent with method {self.method!r} (a draft model is method "
                                            "'draft_model')")
        if self.draft_tensor_parallel_size != 1:
            raise ValidationError.bad_value("speculative_config.draft_tensor_parallel_size",
                                            self.draft_tensor_parallel_size, "1 (the draft runs whole on each rank)")

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def from_user(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """The config from ``speculative_config`` as given: a dict, its JSON text (the CLI flag), or None (off).

        As vLLM: ngram with only one of prompt_lookup_min / max sets both to it; suffix's default
        num_speculative_tokens is its max_tree_depth; a "model" without a "method" is a draft model."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValidationError(f"unknown speculative_config key(s) {unknown}; known keys: {sorted(known)}",
                                  param=f"speculative_config.{unknown[0]}", value=value[unknown[0]])
        value = dict(value)
        if "model" in value and value.get("model") is not None and "method" not in value:
            value["method"] = "draft_model"
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if (lo is None) != (hi is None):
            value["prompt_lookup_min"] = value["prompt_lookup_max"] = lo if hi is None else hi
        if value.get("method") == "suffix" and "num_speculative_tokens" not in value:
            value["num_speculative_tokens"] = min(MAX_SPEC_TOKENS, value.get("suffix_decoding_max_tree_depth", 24))
        return cls(**{k: v for k, v in value.items() if v is not None or k in ("model", "disable_by_batch_size")})


DEFAULT_GRAMMAR_CACHE_BYTES = 512 * 1024**2
"""Compiled grammars kept per process by default (vLLM's VLLM_XGRAMMAR_CACHE_MB default)."""


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsConfig:
    """Structured outputs (grammar-constrained decoding through xgrammar)."""

    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    """Bytes of compiled grammars one process keeps, as measured (least recently used out; a grammar a running
    request holds stays alive until that request ends)."""
    max_grammar_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES // 4
    """Most bytes one request's compiled grammar may hold, as measured; a constraint compiling to more is
    refused (400 naming it). At most grammar_cache_bytes."""

    def __post_init__(self) -> None:
        for name, param in (("grammar_cache_bytes", "grammar_cache_memory"),
                            ("max_grammar_bytes", "max_grammar_memory")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValidationError.bad_value(param, value, "a positive size")
        if self.max_grammar_bytes > self.grammar_cache_bytes:
            raise ValidationError.bad_value("max_grammar_memory", self.max_grammar_bytes,
                                            f"at most grammar_cache_memory ({self.grammar_cache_bytes} bytes)")


WATERMARK_SCOPES = ("none", "single_turn", "all")
"""watermark_config deduplicate_contexts: where a repeated context is searched for (vLLM's values)."""


@dataclass(frozen=True, kw_only=True)
class WatermarkConfig:
    """Text watermarking (vLLM's ``watermark_config`` keys): sampled tokens are chosen by keyed Gumbel-max
    sampling (pagedllm/worker/watermark.py)."""

    key: int
    """The secret key, 0 <= key < 2**64."""
    algorithm: str = "gumbel"
    """"gumbel" (vLLM's "dual_key_gumbel", for speculative decoding, is refused)."""
    context_width: int = 4
    """How many of the last generated tokens key each draw."""
    deduplicate_contexts: str = "single_turn"
    """A context already seen in the reply ("single_turn"), or in the prompt and reply ("all", which also leaves
    the first context_width tokens unwatermarked), is sampled without the watermark; "none": never."""
    deduplicate_contexts_max_history: int | None = 8192
    """How many of the most recent positions that search covers (None: all)."""
    prf: str = "philox"
    """The keyed pseudo-random function: Philox4x32-10."""
    enforce: bool = False
    """Requests' ``watermarking: false`` is overridden (every sampled row is watermarked)."""

    def __post_init__(self) -> None:
        if self.algorithm != "gumbel":
            expected = "'gumbel' ('dual_key_gumbel' is not supported by this server)" \
                if self.algorithm == "dual_key_gumbel" else "'gumbel'"
            raise ValidationError.bad_value("watermark_config.algorithm", self.algorithm, expected)
        if isinstance(self.key, bool) or not isinstance(self.key, int) or not 0 <= self.key < 2 ** 64:
            raise ValidationError.bad_value("watermark_config.key", self.key, "an integer in [0, 2**64)")
        if isinstance(self.context_width, bool) or not isinstance(self.context_width, int) or \
                not 1 <= self.context_width <= 64:
            raise ValidationError.bad_value("watermark_config.context_width", self.context_width,
                                            "an integer in [1, 64]")
        if self.deduplicate_contexts not in WATERMARK_SCOPES:
            raise ValidationError.bad_value("watermark_config.deduplicate_contexts", self.deduplicate_contexts,
                                            " or ".join(repr(s) for s in WATERMARK_SCOPES))
        history = self.deduplicate_contexts_max_history
        if history is not None and (isinstance(history, bool) or not isinstance(history, int) or history < 1):
            raise ValidationError.bad_value("watermark_config.deduplicate_contexts_max_history", history,
                                            "a positive integer or null")
        if self.prf != "philox":
            raise ValidationError.bad_value("watermark_config.prf", self.prf, "'philox'")
        if not isinstance(self.enforce, bool):
            raise ValidationError.bad_value("watermark_config.enforce", self.enforce, "true or false")

    @classmethod
    def from_user(cls, value: str | dict | None) -> WatermarkConfig | None:
        """The config from ``watermark_config`` as given: a dict, its JSON text (the CLI flag), or None (off); an
        unknown key (vLLM's alpha and allow_target_only_watermarking, which are for dual_key_gumbel and
        speculative decoding, included) is refused naming it."""
        if value is None:
            return None
        value = json_object(value, "watermark_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValidationError(f"watermark_config key {unknown[0]!r} is not supported by this server; known keys: "
                                  f"{sorted(known)}", param=f"watermark_config.{unknown[0]}", value=value[unknown[0]])
        if "key" not in value:
            raise ValidationError("watermark_config needs a key (the secret key)", param="watermark_config.key")
        return cls(**value)
