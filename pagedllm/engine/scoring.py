"""Scoring pairs of texts, shared by ``LLM.score`` and the server's /score and /rerank: which pairs, a
cross-encoder's pair input (one sequence, segment ids), and the cosine of two embeddings."""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pagedllm.errors import ValidationError


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str],
                names: tuple[str, str] = ("data_1", "data_2")) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of the others (1 -> N), or text i against text i (N -> N)."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, texts in zip(names, (first, second)):
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValidationError.bad_value(name, texts, "a string or a non-empty list of strings")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValidationError(f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: give one text, or "
                              "as many as the other side", param=names[1], value=len(second))
    return list(zip(first, second))


def pair_prompt(tokenizer: Any, text_1: str, text_2: str, truncate: int | None, max_model_len: int) -> dict[str, Any]:
    """A cross-encoder's input for a pair, tokenized as the model was trained ([CLS] a [SEP] b [SEP], segment
    ids 0 then 1): {"prompt_token_ids", "token_type_ids", "prompt"}. ``truncate`` (-1: max_model_len) cuts the
    pair to that many tokens, the longer text first (the tokenizer's "longest_first")."""
    limit = None if truncate is None else (max_model_len if truncate == -1 else truncate)
    encoded = tokenizer(text_1, text_2, truncation="longest_first" if limit else False, max_length=limit,
                        return_token_type_ids=True)
    ids = list(encoded["input_ids"])
    types = encoded.get("token_type_ids")
    return {"prompt_token_ids": ids, "prompt": f"{text_1}\n{text_2}",
            **({"token_type_ids": list(types)} if types is not None and any(types) else {})}


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two vectors (0 where one of them is all zeros)."""
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0
