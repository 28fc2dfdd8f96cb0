"""POST /cohere/v2/chat and /cohere/v2/chat/render: Cohere's Chat v2 API as a thin mapping onto the chat
completions path, as vLLM serves it.

A v2 request becomes a ChatCompletionRequest (system / user / assistant / tool messages -> chat messages,
thinking blocks and tool_plan -> the assistant's reasoning, tools and tool_choice REQUIRED / NONE -> chat's,
stop_sequences -> stop, p / k -> top_p / top_k, documents / citation_options / safety_mode / thinking -> the chat
template's variables, as vLLM forwards them) and runs through OpenAIServingChat.start: the same template,
limits, tool calling, structured outputs and reasoning parser. The reply is mapped back into Cohere's message
(thinking and text content blocks, tool_calls, tool_plan), finish_reason enum and usage; a stream into Cohere's
message-start / content-start / content-delta / content-end / tool-call-* / message-end events, then [DONE].
Errors on /cohere/ paths take Cohere's shape, {"message": ..., "id": ...} (api_server.error_response).

/cohere/v2/chat/render (--enable-scale-out) renders the same request without running it: the prompt's token ids
and the sampling params the chat endpoint would queue.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, StrictBool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatLogprobs,
    ErrorInfo,
    OpenAIModel,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_render import render_chat
from pagedllm.entrypoints.openai.translate import chat_request, check_keys, renamed, string_field
from pagedllm.errors import ValidationError, quoted

PARAM_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "top_p": "p", "top_k": "k"}
"""A chat request's field -> the v2 field it was made from (an error names what the client sent)."""
FINISH_REASONS = {"stop": "COMPLETE", "length": "MAX_TOKENS", "tool_calls": "TOOL_CALL", "error": "ERROR",
                  "abort": "ERROR"}
"""Chat's finish_reason -> Cohere's ("stop" with a stop string: STOP_SEQUENCE)."""
TEMPLATE_FIELDS = ("documents", "citation_options", "safety_mode", "thinking")
"""v2 fields the chat template sees as variables of their name (as vLLM forwards them; a template that does not
use them renders as without them)."""


@dataclass(frozen=True)
class CohereChatOptions:
    """`pagedllm serve`'s flags for the Cohere chat routes."""

    is_reasoning_model: bool = True
    """--cohere-is-reasoning-model: reasoning is a thinking content block; False: the reply's tool_plan."""


class CohereChatRequest(OpenAIModel):
    """POST /cohere/v2/chat's body (Cohere's v2 fields and vLLM's extras; any other key is a 400 naming it)."""

    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    """[{"type": "function", "function": {"name", "description", "parameters"}}]."""
    strict_tools: StrictBool | None = None
    """Each tool's calls follow its parameters' schema (chat's per-function strict)."""
    tool_choice: Literal["REQUIRED", "NONE"] | None = None
    documents: list[str | dict[str, Any]] | None = None
    citation_options: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    """{"type": "text"} or {"type": "json_object", "json_schema": {...}?}."""
    safety_mode: Literal["CONTEXTUAL", "STRICT", "OFF"] | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    k: int | None = None
    p: float | None = None
    logprobs: StrictBool | None = None
    """Each generated token's log-probability, with its id, in the reply's logprobs (not streamed)."""
    thinking: dict[str, Any] | None = None
    """{"type": "enabled" | "disabled", "token_budget": N?}: the template's thinking variable."""
    priority: int | None = None
    """Refused unless 0: this server does not schedule by priority."""
    watermarking: StrictBool | None = None
    """vLLM's extra: false opts out of the server's --watermark-config (true without one is refused)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's extra: more variables the chat template sees."""


class CohereServingChat:
    """Cohere's Chat v2 API over a chat server's request path."""

    def __init__(self, chat: OpenAIServingChat, options: CohereChatOptions | None = None) -> None:
        self.chat = chat
        self.options = options or CohereChatOptions()

    async def create(self, req: CohereChatRequest, raw: Request) -> Response:
        chat_req = self.chat_request(req)
        try:
            run = await self.chat.start(chat_req, raw)
        except ValidationError as e:
            raise renamed(e, PARAM_NAMES) from None
        if run is None:
            return Response(status_code=499)  # the client went away while its request was prepared
        if req.stream:
            return StreamingResponse(self.chat.with_error_events(self._events(run, chat_req), _error_events),
                                     media_type="text/event-stream")
        completion = await self.chat.response(run, raw)
        if completion is None:
            return Response(status_code=499)
        choice = completion.choices[0]
        m = choice.message
        calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
        message: dict[str, Any] = {"role": "assistant"}
        blocks = []
        if m.reasoning_content and (self.options.is_reasoning_model or not calls):
            blocks.append({"type": "thinking", "thinking": m.reasoning_content})
        elif m.reasoning_content:  # an older Command model plans before its tool calls
            message["tool_plan"] = m.reasoning_content
        if m.content or not calls:
            blocks.append({"type": "text", "text": m.content or ""})
        if blocks:
            message["content"] = blocks
        if calls:
            message["tool_calls"] = [_tool_call(*call) for call in calls]
        body: dict[str, Any] = {"id": run.request_id, "message": message, "usage": _usage(completion.usage),
                                "finish_reason": _finish(choice.finish_reason, choice.stop_reason)}
        if req.logprobs:
            body["logprobs"] = _logprobs(choice.logprobs, choice.token_ids)
        return JSONResponse(body)

    async def render(self, req: CohereChatRequest, raw: Request) -> dict[str, Any]:
        """vLLM's GenerateRequest of the chat request ``req`` becomes: what /v1/chat/completions/render answers
        for it (serving_render.py), nothing generated."""
        try:
            return await render_chat(self.chat, self.chat_request(req))
        except ValidationError as e:
            raise renamed(e, PARAM_NAMES) from None

    def chat_request(self, req: CohereChatRequest) -> ChatCompletionRequest:
        """The chat completion request a v2 request maps onto (400 naming what cannot be)."""
        if req.priority not in (None, 0):
            raise ValidationError.bad_value("priority", req.priority, "0 (this server does not schedule by priority)")
        kwargs = dict(req.chat_template_kwargs or {})
        for name in TEMPLATE_FIELDS:
            value = getattr(req, name)
            if value is not None:
                kwargs.setdefault(name, _documents(value) if name == "documents" else value)
        if req.thinking is not None:
            check_keys(req.thinking, {"type", "token_budget"}, "thinking")
            if req.thinking.get("type") not in ("enabled", "disabled"):
                raise ValidationError.bad_value("thinking.type", req.thinking.get("type"), "'enabled' or 'disabled'")
        fields: dict[str, Any] = {
            "model": req.model, "messages": _chat_messages(req.messages), "max_completion_tokens": req.max_tokens,
            "stop": req.stop_sequences, "temperature": req.temperature, "top_p": req.p, "top_k": req.k,
            "seed": req.seed, "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
            "logprobs": bool(req.logprobs), "return_token_ids": True if req.logprobs else None,
            "watermarking": req.watermarking,
            "tools": _chat_tools(req.tools, bool(req.strict_tools)),
            "tool_choice": {"REQUIRED": "required", "NONE": "none"}.get(req.tool_choice or ""),
            "response_format": _response_format(req.response_format), "stream": req.stream,
            "chat_template_kwargs": kwargs or None}
        if req.stream:
            fields["stream_options"] = {"include_usage": True}  # (message-end's usage)
        return chat_request({k: v for k, v in fields.items() if v is not None}, PARAM_NAMES)  # (None: chat's default)

    async def _events(self, run: Any, chat_req: ChatCompletionRequest) -> AsyncIterator[str]:
        """Cohere's stream: message-start, then per block content-start / content-delta... / content-end
        (thinking, text), tool-plan-delta (no block) or tool-call-start / tool-call-end, then message-end with
        the finish_reason and usage, then [DONE]."""
        yield _event({"type": "message-start", "id": run.request_id, "delta": {"message": {"role": "assistant"}}})
        index, open_kind, tools = -1, None, 0
        finish, stop, usage = None, None, None

        def close() -> list[str]:
            nonlocal open_kind
            if open_kind is None:
                return []
            open_kind = None
            return [_event({"type": "content-end", "index": index})]

        async for chunk in self.chat.chunks(run, chat_req):
            if not chunk.choices:
                usage = chunk.usage
                continue
            choice = chunk.choices[0]
            if choice.finish_reason is not None:
                finish, stop = choice.finish_reason, choice.stop_reason
            delta = choice.delta
            pieces = [("thinking", delta.reasoning_content), ("text", delta.content)]
            if delta.reasoning_content and not self.options.is_reasoning_model:  # an older Command model's plan
                for event in close():
                    yield event
                yield _event({"type": "tool-plan-delta", "delta": {"message": {"tool_plan": delta.reasoning_content}}})
                pieces = pieces[1:]
            for kind, piece in pieces:
                if not piece:
                    continue
                if open_kind != kind:
                    for event in close():
                        yield event
                    index, open_kind = index + 1, kind
                    yield _event({"type": "content-start", "index": index,
                                  "delta": {"message": {"content": {"type": kind, kind: ""}}}})
                yield _event({"type": "content-delta", "index": index,
                              "delta": {"message": {"content": {kind: piece}}}})
            for call in delta.tool_calls or []:
                for event in close():
                    yield event
                yield _event({"type": "tool-call-start", "index": tools, "delta": {"message": {
                    "tool_calls": _tool_call(call.id, call.function.name, call.function.arguments)}}})
                yield _event({"type": "tool-call-end", "index": tools})
                tools += 1
        for event in close():
            yield event
        end: dict[str, Any] = {"finish_reason": _finish(finish, stop)}
        if usage is not None:
            end["usage"] = _usage(usage)
        yield _event({"type": "message-end", "id": run.request_id, "delta": end})
        yield "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    """One SSE frame: bare ``data:`` (the JSON's ``type`` names the event), as Cohere's stream."""
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _error_events(error: ErrorInfo) -> list[str]:
    """A failure after the stream began: message-end with finish_reason ERROR and the error, then [DONE]."""
    return [_event({"type": "message-end", "delta": {"error": error.message, "finish_reason": "ERROR"}}),
            "data: [DONE]\n\n"]


def _finish(reason: str | None, stop: int | str | None) -> str:
    if reason == "stop" and isinstance(stop, str):
        return "STOP_SEQUENCE"
    return FINISH_REASONS.get(reason or "", "COMPLETE")


def _usage(usage: UsageInfo | None) -> dict[str, Any]:
    """Cohere's usage: billed_units and tokens (the same counts here), cached_tokens the prefix-cache hits."""
    if usage is None:
        return {}
    counts = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}
    return {"billed_units": dict(counts), "tokens": dict(counts), "cached_tokens": max(usage.cached_tokens, 0)}


def _logprobs(logprobs: ChatLogprobs | None, token_ids: list[int] | None) -> list[dict[str, Any]]:
    """Cohere's logprobs: per generated token {text, token_ids: [id], logprobs: [logprob]}."""
    if logprobs is None or token_ids is None:
        return []
    return [{"text": entry.token, "token_ids": [token_id], "logprobs": [entry.logprob]}
            for entry, token_id in zip(logprobs.content, token_ids)]


def _tool_call(call_id: str | None, name: str | None, arguments: str | None) -> dict[str, Any]:
    return {"id": call_id or random_id("call"), "type": "function",
            "function": {"name": name or "", "arguments": arguments or "{}"}}


def _documents(documents: list[str | dict[str, Any]]) -> list[dict[str, Any]]:
    """The template's documents, as vLLM forwards them: {"id", "data": {...}} (a string: {"text": it})."""
    out = []
    for i, doc in enumerate(documents):
        if isinstance(doc, str):
            out.append({"id": f"doc_{i}", "data": {"text": doc}})
            continue
        check_keys(doc, {"id", "data"}, f"documents[{i}]")
        data = doc.get("data")
        if not isinstance(data, (dict, str)):
            raise ValidationError.bad_value(f"documents[{i}].data", data, "an object or a string")
        out.append({"id": doc.get("id") or f"doc_{i}", "data": data if isinstance(data, dict) else {"text": data}})
    return out


def _chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """v2 messages as chat messages (developer is system, as vLLM aliases it); a key or block this server does not
    take is a 400 naming it."""
    return [_chat_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _chat_message(message: dict[str, Any], where: str) -> dict[str, Any]:
    """One v2 message as a chat message (``where``: its place in the request, for errors)."""
    role = message.get("role")
    role = "system" if role == "developer" else role
    if role in ("system", "user"):
        check_keys(message, {"role", "content"}, where)
        return {"role": role, "content": _content(message.get("content"), f"{where}.content", images=role == "user")}
    if role == "assistant":
        check_keys(message, {"role", "content", "tool_calls", "tool_plan", "citations"}, where)
        return _assistant(message, where)
    if role == "tool":
        check_keys(message, {"role", "content", "tool_call_id"}, where)
        return {"role": "tool", "tool_call_id": string_field(message, "tool_call_id", where),
                "content": _tool_content(message.get("content"), f"{where}.content")}
    raise ValidationError.bad_value(f"{where}.role", role, "'system', 'user', 'assistant' or 'tool'")


def _content(content: Any, where: str, images: bool = False) -> str | list[dict[str, Any]]:
    """A string, or text blocks (and, for a user, image_url blocks, which the chat path takes or refuses)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError.bad_value(where, content, "a string or a list of content blocks")
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            check_keys(block, {"type", "text"}, at)
            parts.append({"type": "text", "text": string_field(block, "text", at)})
        elif kind == "image_url" and images:
            check_keys(block, {"type", "image_url"}, at)
            parts.append({"type": "image_url", "image_url": block.get("image_url")})
        else:
            raise ValidationError(f"{at}: a {quoted(kind)} block is not supported here (text"
                                  f"{', image_url' if images else ''})", param=f"{at}.type", value=kind)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _assistant(message: dict[str, Any], where: str) -> dict[str, Any]:
    """An earlier assistant turn: text blocks -> content, thinking blocks and tool_plan -> reasoning (the template
    shows or drops it), tool_calls -> chat's; its citations describe that reply's text and add nothing to it."""
    content, texts, thinking = message.get("content"), [], []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in ("text", "thinking"):
                check_keys(block, {"type", kind}, at)
                (texts if kind == "text" else thinking).append(string_field(block, kind, at))
            else:
                raise ValidationError(f"{at}: a {quoted(kind)} block is not supported here (text, thinking)",
                                      param=f"{at}.type", value=kind)
    elif content is not None:
        raise ValidationError.bad_value(f"{where}.content", content, "a string or a list of content blocks")
    if message.get("tool_plan") is not None:
        thinking.append(string_field(message, "tool_plan", where))
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        out["reasoning"] = "".join(thinking)
    calls = []
    for j, call in enumerate(message.get("tool_calls") or []):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise ValidationError.bad_value(at, call, '{"id", "type": "function", "function": {"name", "arguments"}}')
        check_keys(call, {"id", "type", "function"}, at)
        check_keys(call["function"], {"name", "arguments"}, f"{at}.function")
        calls.append({"id": call.get("id") or random_id("call"), "type": "function", "function": {
            "name": string_field(call["function"], "name", f"{at}.function"),
            "arguments": call["function"].get("arguments") or "{}"}})
    if calls:
        out["tool_calls"] = calls
    return out


def _tool_content(content: Any, where: str) -> str:
    """A tool result: a string, or text and document blocks (a document as its JSON text, as vLLM renders it)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError.bad_value(where, content, "a string or a list of content blocks")
    texts = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            check_keys(block, {"type", "text"}, at)
            texts.append(string_field(block, "text", at))
        elif kind == "document" and isinstance(block.get("document"), dict):
            check_keys(block, {"type", "document"}, at)
            texts.append(json.dumps(block["document"], ensure_ascii=False))
        else:
            raise ValidationError(f"{at}: a {quoted(kind)} block is not supported here (text, document)",
                                  param=f"{at}.type", value=kind)
    return "\n".join(texts)


def _chat_tools(tools: list[dict[str, Any]] | None, strict: bool) -> list[dict[str, Any]] | None:
    """v2 tools (chat's own shape) with strict_tools as each function's strict."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        check_keys(tool, {"type", "function"}, f"tools[{i}]")
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValidationError.bad_value(f"tools[{i}]", tool, '{"type": "function", "function": {...}}')
        check_keys(fn, {"name", "description", "parameters"}, f"tools[{i}].function")
        out.append({"type": "function", "function": {**fn, **({"strict": True} if strict else {})}})
    return out


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """v2's response_format as chat's: text (none), json_object (any JSON object, or its json_schema's)."""
    if fmt is None:
        return None
    if fmt.get("type") == "text":
        check_keys(fmt, {"type"}, "response_format")
        return None
    if fmt.get("type") != "json_object":
        raise ValidationError.bad_value("response_format.type", fmt.get("type"), "'text' or 'json_object'")
    check_keys(fmt, {"type", "json_schema"}, "response_format")
    schema = fmt.get("json_schema")
    if schema is None:
        return {"type": "json_object"}
    if not isinstance(schema, dict):
        raise ValidationError.bad_value("response_format.json_schema", schema, "a JSON schema object")
    return {"type": "json_schema", "json_schema": {"name": "cohere_v2_json_schema", "schema": schema}}
