"""Long-text embeddings (``--pooler-config '{"enable_chunked_processing": true, "max_embed_len": N}'``, as vLLM):
an input longer than max_model_len is cut into chunks of max_model_len tokens, each chunk is embedded as an input
of its own, and the input's embedding is the mean of its chunks' embeddings weighted by their token counts,
scaled to unit length again when the chunks' embeddings were normalized. Cohere's ``embedding_types`` encodings
of a finished embedding are here too."""
from __future__ import annotations

import base64

import numpy as np


def split_chunks(ids: list[int], size: int) -> list[list[int]]:
    """``ids`` cut into consecutive chunks of ``size`` tokens (the last one shorter); one chunk when it fits."""
    if size < 1:
        raise ValueError(f"chunk size must be positive, got {size}")
    return [ids[start:start + size] for start in range(0, len(ids), size)] or [ids]


def combine_chunks(vectors: list[list[float]], weights: list[int], normalize: bool) -> list[float]:
    """One input's embedding from its chunks' (in order): their mean weighted by ``weights`` (each chunk's token
    count), scaled to unit length when ``normalize`` and there was more than one chunk (one chunk: its own
    embedding, unchanged)."""
    if len(vectors) != len(weights) or not vectors:
        raise ValueError(f"{len(vectors)} chunk vectors for {len(weights)} weights")
    if len(vectors) == 1:
        return list(vectors[0])
    stacked = np.asarray(vectors, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    mean = (stacked * w[:, None]).sum(axis=0) / w.sum()
    if normalize:
        norm = float(np.linalg.norm(mean))
        if norm > 0:
            mean = mean / norm
    return mean.astype(np.float32).tolist()


COHERE_EMBEDDING_TYPES = ("float", "binary", "ubinary", "base64")
"""The ``embedding_types`` /v2/embed returns (vLLM's set): Cohere's int8 and uint8 are scalar quantizations
calibrated on Cohere's own models, which a generic model has no calibration for, so they are refused."""


def cohere_encode(vectors: list[list[float]], kind: str) -> list[list[float]] | list[list[int]] | list[str]:
    """Every embedding in one of COHERE_EMBEDDING_TYPES: "float" as they are; "ubinary" one bit per value (1 where
    it is >= 0), eight to a byte, the first value in the byte's highest bit, each byte 0..255; "binary" the same
    bytes less 128 (-128..127); "base64" each vector's little-endian float32 bytes. Binary kinds need a size that
    is a multiple of 8 (ValueError otherwise)."""
    if kind == "float":
        return vectors
    if kind == "base64":
        return [base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii") for v in vectors]
    if kind not in ("binary", "ubinary"):
        raise ValueError(f"unknown embedding type {kind!r}")
    array = np.asarray(vectors, dtype=np.float64)
    if array.shape[-1] % 8:
        raise ValueError(f"{kind} embeddings need a size that is a multiple of 8, this one is {array.shape[-1]}")
    packed = np.packbits(array >= 0, axis=-1).astype(np.int16)
    return (packed - 128 if kind == "binary" else packed).tolist()
