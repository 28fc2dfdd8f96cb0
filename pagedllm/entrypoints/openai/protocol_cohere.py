"""Pydantic models of Cohere's embed API, POST /v2/embed, in the shape vLLM serves it (texts, or text-only
``inputs`` rendered through the chat template; ``embedding_types`` float, binary, ubinary, base64). What we do
not run (images) is refused naming the field."""
from __future__ import annotations

import builtins
from typing import Literal

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol import OpenAIModel, random_id


class CohereContent(OpenAIModel):
    """One part of an ``inputs`` item: {"type": "text", "text": ...} (an image_url part is refused)."""

    type: str
    text: str | None = None
    image_url: dict | None = None


class CohereInput(OpenAIModel):
    """One ``inputs`` item: its content parts, embedded together as one user message."""

    content: list[CohereContent]


class CohereEmbedRequest(OpenAIModel):
    """POST /v2/embed: exactly one of texts, images and inputs."""

    model: str | None = None
    texts: list[str] | None = None
    images: list[str] | None = None
    """Refused: this server runs no vision models."""
    inputs: list[CohereInput] | None = None
    input_type: str | None = None
    """A task named in the model's prompts (config_sentence_transformers.json ``prompts``, e.g. "query"): its
    prefix goes before each text (as a system message where the model has a chat template, as vLLM)."""
    embedding_types: list[str] | None = None
    """Which encodings come back (default ["float"]): float, binary, ubinary, base64."""
    output_dimension: int | None = None
    """Keep the first this many values (Matryoshka models)."""
    truncate: Literal["NONE", "START", "END"] = "END"
    """A text over the limit (max_tokens, else max_model_len) is cut at its end (END), its start (START), or
    refused (NONE)."""
    max_tokens: int | None = None
    """The limit ``truncate`` applies (at most max_model_len)."""
    priority: int = 0
    """vLLM's: only 0 (this server does not schedule by priority)."""


class CohereApiVersion(BaseModel):
    version: str = "2"


class CohereBilledUnits(BaseModel):
    input_tokens: int
    image_tokens: int = 0


class CohereMeta(BaseModel):
    api_version: CohereApiVersion = Field(default_factory=CohereApiVersion)
    billed_units: CohereBilledUnits


class CohereEmbeddings(BaseModel):
    """One list per requested embedding type (the others left out of the answer)."""

    float: list[list[builtins.float]] | None = None  # Cohere's key (shadows the type: builtins.float)
    binary: list[list[int]] | None = None
    ubinary: list[list[int]] | None = None
    base64: list[str] | None = None


class CohereEmbedResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    embeddings: CohereEmbeddings
    texts: list[str] | None = None
    """The request's texts, echoed (None for inputs)."""
    meta: CohereMeta
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"
