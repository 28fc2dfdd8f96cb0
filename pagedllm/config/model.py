"""The model's config and its pooler's (what a pooling model pools, normalizes and accepts).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pagedllm.config.values import json_object
from pagedllm.errors import ValidationError

DEFAULT_MAX_LOGPROBS = 20
"""EngineArgs.max_logprobs' default (vLLM's: OpenAI's own bound on top_logprobs)."""

POOLING_TYPES = ("CLS", "MEAN", "LAST", "MAX")
CHUNKED_POOLING_TYPES = ("CLS", "MEAN", "LAST")
"""The poolings enable_chunked_processing takes (vLLM's: it has no MAX pooling)."""


@dataclass(frozen=True, kw_only=True)
class PoolerConfig:
    """How a pooling model turns a sequence's hidden states into its vector (vLLM's ``pooler_config``)."""

    pooling_type: str = "LAST"
    """"CLS" (first token), "MEAN", "LAST" (decoder embedders) or "MAX": from the sentence-transformers Pooling
    module where the model folder has one."""
    normalize: bool = True
    """Embeddings are scaled to unit length by default (a request's ``normalize`` overrides it): the
    sentence-transformers Normalize module, or True for decoder embedders."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """A Matryoshka model's trained output sizes (config.json ``matryoshka_dimensions``); None: it is not one, and a
    request's ``dimensions`` other than the full size is refused. Empty: any size up to hidden_size."""
    enable_chunked_processing: bool = False
    """Embeddings of inputs longer than max_model_len (vLLM's long-text embedding): the input is cut into chunks of
    max_model_len tokens, each pooled as an input of its own, and the chunks' vectors averaged, weighted by their
    token counts (normalized again where the embeddings are). Needs CLS, MEAN or LAST pooling."""
    max_embed_len: int | None = None
    """Most tokens of one input to /v1/embeddings and /v2/embed (a longer one is refused, naming it); with
    enable_chunked_processing it may exceed max_model_len. None: max_model_len (with chunking: the prompt byte cap
    bounds an input)."""
    task_prompts: dict[str, str] = field(default_factory=dict)
    """The prefix the model puts before an input per task (Cohere's ``input_type``, e.g. {"query": "query: "}), read
    from the model folder; empty: none."""

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValidationError.bad_value("pooler_config.pooling_type", self.pooling_type,
                                            f"one of {list(POOLING_TYPES)}")
        if not isinstance(self.normalize, bool):
            raise ValidationError.bad_value("pooler_config.normalize", self.normalize, "true or false")
        if not isinstance(self.enable_chunked_processing, bool):
            raise ValidationError.bad_value("pooler_config.enable_chunked_processing",
                                            self.enable_chunked_processing, "true or false")
        if self.max_embed_len is not None and (not isinstance(self.max_embed_len, int)
                                               or isinstance(self.max_embed_len, bool) or self.max_embed_len < 1):
            raise ValidationError.bad_value("pooler_config.max_embed_len", self.max_embed_len,
                                            "a positive number of tokens, or null")
        if self.enable_chunked_processing and self.pooling_type not in CHUNKED_POOLING_TYPES:
            raise ValidationError(f"enable_chunked_processing averages the vectors of an input's chunks, which needs "
                                  f"one of {list(CHUNKED_POOLING_TYPES)} pooling (vLLM's pooling types); this model "
                                  f"pools by {self.pooling_type}", param="pooler_config.enable_chunked_processing",
                                  value=True)

    @classmethod
    def from_user(cls, base: PoolerConfig, value: dict[str, Any] | str | None) -> PoolerConfig:
        """``base`` (the model's own) with the keys of ``pooler_config`` (a dict or its JSON text) over it."""
        if value is None:
            return base
        value = json_object(value, "pooler_config")
        known = {"pooling_type", "normalize", "use_activation", "enable_chunked_processing", "max_embed_len"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValidationError(f"unknown pooler_config key(s) {unknown}; known keys: {sorted(known)}",
                                  param=f"pooler_config.{unknown[0]}", value=value[unknown[0]])
        if "normalize" in value and "use_activation" in value:
            raise ValidationError("give normalize or use_activation (vLLM's newer name of it), not both",
                                  param="pooler_config.use_activation", value=value["use_activation"])
        pooling_type = value.get("pooling_type", base.pooling_type)
        normalize = value.get("normalize", value.get("use_activation", base.normalize))
        return dataclasses.replace(base, pooling_type=pooling_type.upper() if isinstance(pooling_type, str)
                                   else pooling_type, normalize=normalize,
                                   enable_chunked_processing=value.get("enable_chunked_processing",
                                                                       base.enable_chunked_processing),
                                   max_embed_len=value.get("max_embed_len", base.max_embed_len))


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What model to run and how."""

    model: str
    """Path of an HF folder or a .gguf file."""
    dtype: str
    """Resolved run dtype: "float32", "bfloat16" or "float16"."""
    max_model_len: int
    """Most tokens (prompt + output) in one sequence."""
    seed: int = 0
    """Seed of the engine's random generator (requests without their own seed)."""
    load_format: str = "auto"
    """"auto" (the checkpoint's weights) or "dummy" (random weights, only config.json read)."""
    quantization: str | None = None
    """"gguf": a GGUF file's quantized weights stay in their formats; "int8": weights quantized to int8 per
    output channel at load; None: every weight in dtype."""
    runner: str = "generate"
    """"generate" (tokens out) or "pooling" (one vector per request: embeddings, classes, scores)."""
    convert: str = "none"
    """How a pooling runner uses the checkpoint: "embed" (pooled hidden states), "classify" (its
    classification head: *ForSequenceClassification), or "none" (a generating model)."""
    pooler: PoolerConfig | None = None
    """The pooling runner's pooling (None with runner "generate")."""
    encoder_only: bool = False
    """Bidirectional attention over whole inputs (BERT-style): no KV pool, inputs are never chunked."""
    labels: tuple[str, ...] = ()
    """A classifier's label names in output order (its config's id2label; "LABEL_i" where it has none)."""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    """Most log-probabilities a request may ask for per token (logprobs, prompt_logprobs; EngineArgs.max_logprobs
    with -1 resolved to the vocabulary size)."""
    enable_sleep_mode: bool = False
    """Sleep levels 1 and 2 allowed (the KV pool, and at level 2 the weights, released until wake_up)."""
    enable_prompt_embeds: bool = False
    """Prompts may be given as embeddings (EngineArgs.enable_prompt_embeds)."""

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValidationError.bad_value("load_format", self.load_format, "'auto' or 'dummy'")
        if self.quantization not in (None, "gguf", "int8"):
            raise ValidationError.bad_value("quantization", self.quantization,
                                            "'auto' (resolved before this), 'gguf', 'int8' or None")
        if self.quantization is not None and self.load_format == "dummy":
            raise ValidationError.bad_value("quantization", self.quantization,
                                            "None with load_format='dummy' (random weights are not quantized)")
        if self.quantization == "gguf" and not self.model.endswith(".gguf"):
            raise ValidationError.bad_value("quantization", self.quantization,
                                            "None for a model that is not a .gguf file")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValidationError.bad_value("dtype", self.dtype, "'auto', 'float32', 'bfloat16' or 'float16'")
        if self.max_model_len < 1:
            raise ValidationError.bad_value("max_model_len", self.max_model_len, ">= 1")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValidationError.bad_value("max_logprobs", self.max_logprobs, "an integer >= 0 (resolved before this)")
        if self.runner not in ("generate", "pooling"):
            raise ValidationError.bad_value("runner", self.runner, "'auto', 'generate' or 'pooling'")
        if (self.runner == "pooling") != (self.pooler is not None and self.convert in ("embed", "classify")):
            raise ValidationError.bad_value("convert", self.convert, "'embed' or 'classify' with runner 'pooling', "
                                            "'none' with runner 'generate'")

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """The pooling tasks this model serves: an embedding model embeds and scores pairs by cosine; a
        classifier classifies and scores (a cross-encoder's one logit); a generating model none."""
        if self.runner != "pooling":
            return ()
        if self.convert == "embed":
            return ("embed", "score")
        return ("classify", "score") if len(self.labels) == 1 else ("classify",)  # a score is one logit
