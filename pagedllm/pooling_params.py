"""PoolingParams: what a pooling request (embedding, classification, score) returns, with vLLM's names."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import ValidationError

#: The tasks a pooling request can ask for (vLLM's names).
POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """Parameters of one pooling request (vLLM's field names and defaults).

    ``None`` fields take the model's defaults when the engine accepts the request: ``normalize`` from the
    sentence-transformers ``Normalize`` module (decoder embedders: True), ``use_activation`` True (softmax over
    the classes, a sigmoid for one class).
    """

    task: str | None = None
    """"embed", "classify" or "score"; None: the model's first task (an embedding model's is "embed")."""
    dimensions: int | None = None
    """Embeddings: keep the first ``dimensions`` values (Matryoshka models only), normalized after the cut."""
    normalize: bool | None = None
    """Embeddings: scale to unit length (None: as the model's sentence-transformers config says)."""
    use_activation: bool | None = None
    """Classification and scores: softmax / sigmoid over the raw logits (None: True)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last this many prompt tokens (-1: as many as max_model_len allows); None refuses longer
    inputs with an error naming the field."""

    def __post_init__(self) -> None:
        bad = ValidationError.bad_value
        if self.task is not None and self.task not in POOLING_TASKS:
            raise bad("task", self.task, f"one of {list(POOLING_TASKS)}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise bad("dimensions", self.dimensions, "a positive integer")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise bad(name, value, "true, false or null")
        trunc = self.truncate_prompt_tokens
        if trunc is not None and (isinstance(trunc, bool) or not isinstance(trunc, int) or (trunc < 1 and trunc != -1)):
            raise bad("truncate_prompt_tokens", trunc, "a positive integer or -1")
