"""Pydantic models of the Anthropic Messages API requests (responses are plain dicts in its shape)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class AnthropicModel(BaseModel):
    # a field we do not implement is refused (400 naming it), never silently dropped
    model_config = ConfigDict(extra="forbid")


class AnthropicMessage(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]
    """A string, or blocks: text, tool_use (assistant), tool_result (user), thinking (ignored)."""


class CountTokensRequest(AnthropicModel):
    """POST /v1/messages/count_tokens."""

    model: str
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    """{"user_id": ...}: accepted, as OpenAI's ``user``."""
    cache_control: dict[str, Any] | None = None
    """A prompt-caching hint: accepted (prefix caching is automatic here)."""
    output_config: dict[str, Any] | None = None
    """{"format": {"type": "json_schema", "schema": ...}}: the reply follows the schema (structured outputs)."""
