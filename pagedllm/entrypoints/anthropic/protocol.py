"""Pydantic models of the Anthropic Messages API requests (responses are plain dicts in its shape), and its error
body."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 504: "timeout_error"}
"""HTTP status -> Anthropic's error type (anything else: api_error)."""


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class AnthropicModel(BaseModel):
    # a field we do not implement is refused (400 naming it), never silently dropped
    model_config = ConfigDict(extra="forbid")


class AnthropicMessage(AnthropicModel):
    role: Literal["user", "assistant", "system"]
    """"system" (vLLM's extension; Anthropic takes only the top-level ``system``): its text joins the system
    prompt, after ``system``'s."""
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
    min_tokens: int = 0
    """vLLM's extra: no stop (end of turn or stop sequence) before this many tokens."""
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    """{"user_id": ...}: accepted, as OpenAI's ``user``."""
    cache_control: dict[str, Any] | None = None
    """A prompt-caching hint: accepted (prefix caching is automatic here)."""
    output_config: dict[str, Any] | None = None
    """{"format": {"type": "json_schema", "schema": ...}}: the reply follows the schema (structured outputs)."""
