"""The OpenAI Responses API's request, and the response objects and stream events it answers with
(plain dicts in OpenAI's shape: the SDK's models read them)."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field, StrictBool

from pagedllm.entrypoints.openai.protocol import OpenAIModel, UsageInfo


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses. Fields we cannot honour are refused (400 naming them): unknown ones by the model,
    known ones (``reasoning.summary``, built-in tools, ``include`` values, ...) by the translation."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    """{"format": {"type": "text" | "json_object" | "json_schema", ...}}."""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    store: StrictBool = True
    previous_response_id: str | None = None
    stream: StrictBool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    background: StrictBool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    top_logprobs: int | None = Field(default=None, strict=True, description=(
        "alternatives per output token, with include ['message.output_text.logprobs'] (0: the sampled one only)"))
    seed: int | None = Field(default=None, description="vLLM's extra: a seeded sample")
    thinking_token_budget: int | None = Field(default=None, strict=True, description=(
        "vLLM's extra, as chat's: most tokens inside the reasoning (needs --reasoning-parser; -1: no cap)"))
    include_reasoning: StrictBool = Field(default=True, description=(
        "vLLM's extra, as chat's: false leaves the reasoning items out"))
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description=(
        "vLLM's extra, as chat's: more variables for the chat template (e.g. enable_thinking)"))


def new_id(prefix: str) -> str:
    """An OpenAI-style object id: ``resp_...``, ``msg_...``, ``fc_...``, ``rs_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A reasoning item: the model's thinking (--reasoning-parser) as reasoning_text content."""
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str = "completed",
                 logprobs: list[dict] | None = None) -> dict[str, Any]:
    """An assistant message item with one output_text part (none while it is being opened: ``text`` None);
    ``logprobs``: its tokens' (include message.output_text.logprobs)."""
    content = [] if text is None else [output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text(text: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed",
                       namespace: str | None = None) -> dict[str, Any]:
    """A function_call item; ``namespace``: the namespace tool that holds the function (``name`` its own name in
    it), left out for a top-level function."""
    item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def usage_of(usage: UsageInfo | None) -> dict[str, Any] | None:
    """Chat usage in the Responses API's shape."""
    if usage is None:
        return None
    details = usage.completion_tokens_details
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": details.reasoning_tokens if details else 0},
            "total_tokens": usage.total_tokens}


def response_object(response_id: str, req: ResponsesRequest, model: str, created_at: int, output: list[dict],
                    status: str, usage: dict | None = None, error: dict | None = None) -> dict[str, Any]:
    """The Response object: the request's settings echoed, its output items, status and usage."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": response_id, "object": "response", "created_at": created_at, "model": model,
        "status": status, "output": output, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id, "temperature": req.temperature, "top_p": req.top_p,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
        "text": {"format": fmt}, "truncation": "disabled", "store": req.store, "background": bool(req.background),
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None}, "usage": usage,
        "user": req.user, "top_logprobs": req.top_logprobs,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
    }
