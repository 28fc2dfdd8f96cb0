"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API as a thin mapping onto the
chat completions path.

A request becomes a ChatCompletionRequest (system -> a system message, text / tool_use / tool_result blocks
-> messages with tool_calls and tool messages, tools and tool_choice -> chat's, stop_sequences -> stop)
and runs through OpenAIServingChat.start: the same template, limits, tool calling, structured outputs and
reasoning parser. The reply (or the stream of chat chunks) is mapped back into content blocks and
Anthropic's events; errors on these paths take Anthropic's error shape (see api_server).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError as PydanticValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest, anthropic_error
from pagedllm.entrypoints.openai.limits import check_tools
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ErrorInfo, UsageInfo
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_render import render_chat
from pagedllm.entrypoints.openai.translate import chat_request, check_keys, format_field, renamed, string_field
from pagedllm.errors import ValidationError, quoted

PARAM_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
               "response_format": "output_config.format", "thinking_token_budget": "thinking.budget_tokens"}
"""A chat request's field -> the Messages field it was made from (an error names what the client sent)."""
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
"""Chat's finish_reason -> Anthropic's stop_reason ("stop" is end_turn, or stop_sequence for a stop string)."""
class AnthropicServingMessages:
    """The Messages API over a chat server's request path."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def create(self, req: MessagesRequest, raw: Request) -> Response:
        chat_req = self._chat_request(req)
        try:
            run = await self.chat.start(chat_req, raw)
        except ValidationError as e:
            raise renamed(e, PARAM_NAMES) from None
        if run is None:
            return Response(status_code=499)  # the client went away while its request was prepared
        message_id = f"msg_{uuid.uuid4().hex}"
        if req.stream:
            events = self._events(run, chat_req, message_id)
            return StreamingResponse(self.chat.with_error_events(events, _error_events),
                                     media_type="text/event-stream")
        completion = await self.chat.response(run, raw)
        if completion is None:
            return Response(status_code=499)
        choice = completion.choices[0]
        m = choice.message
        content = _blocks(m.reasoning_content, m.content, [(c.id, c.function.name, c.function.arguments)
                                                            for c in m.tool_calls])
        reason, sequence = _stop_reason(choice.finish_reason, choice.stop_reason, bool(m.tool_calls))
        return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "model": run.model,
                             "content": content, "stop_reason": reason, "stop_sequence": sequence,
                             "usage": _usage(completion.usage)})

    async def count_tokens(self, req: CountTokensRequest) -> dict[str, int]:
        """{"input_tokens": N}: the prompt the same request would run, through the chat template."""
        self.chat.check_model(req.model)
        _thinking_budget(req.thinking, None)
        tools = _chat_tools(req.tools)
        check_tools(tools, self.chat.limits)
        messages = _chat_messages(req)
        self.chat.check_prompt_size(messages, "messages")
        try:
            chat_messages = [ChatMessage(**m) for m in messages]
        except PydanticValidationError as e:
            raise ValidationError(f"messages: {e.errors()[0].get('msg')}", param="messages") from None
        _, ids = self.chat.apply_chat_template(chat_messages, True, tools)
        return {"input_tokens": len(ids)}

    async def render(self, req: MessagesRequest) -> dict[str, Any]:
        """vLLM's /v1/messages/render: the /inference/v1/generate request of the chat request ``req`` maps onto
        (serving_render.py), nothing generated."""
        chat_req = self._chat_request(req)
        try:
            return await render_chat(self.chat, chat_req)
        except ValidationError as e:
            raise renamed(e, PARAM_NAMES) from None

    def _chat_request(self, req: MessagesRequest) -> ChatCompletionRequest:
        """The chat completion request this Messages request maps onto (400 naming what cannot be)."""
        budget = _thinking_budget(req.thinking, req.max_tokens)
        choice, parallel = _chat_tool_choice(req.tool_choice)
        fields: dict[str, Any] = {
            "model": req.model, "messages": _chat_messages(req), "max_completion_tokens": req.max_tokens,
            "stop": req.stop_sequences, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
            "min_tokens": req.min_tokens,
            "tools": _chat_tools(req.tools), "tool_choice": choice, "parallel_tool_calls": parallel,
            "stream": req.stream, "response_format": _response_format(req.output_config)}
        if budget is not None:
            fields["thinking_token_budget"] = budget
        if req.stream:
            fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}  # (message_start's)
        return chat_request(fields, PARAM_NAMES)

    async def _events(self, run: Any, chat_req: ChatCompletionRequest, message_id: str) -> AsyncIterator[str]:
        """A ping (Anthropic's keep-alive event, which its SDKs skip) at once, then message_start with the engine's
        first output (as vLLM: its usage already splits the prompt into input_tokens and cache_read_input_tokens,
        the split message_delta reports; a request queued behind others has the ping to show it is alive), a
        content_block_start / _delta... / _stop per block, message_delta, message_stop."""
        yield _event("ping")
        started = False

        def message_start(usage: UsageInfo) -> str:
            nonlocal started
            started = True
            return _event("message_start", message={
                "id": message_id, "type": "message", "role": "assistant", "model": run.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": _usage(UsageInfo(
                    prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens))})

        blocks = _Blocks()
        finish, stop, usage, called = None, None, None, False
        async for chunk in self.chat.chunks(run, chat_req):
            if chunk.choices and chunk.choices[0].delta.role is not None:
                continue  # (the role chunk goes before the engine's first output: its usage knows no cache reads)
            if not started:
                yield message_start(chunk.usage or UsageInfo(prompt_tokens=run.prompt_tokens))
            if chunk.usage is not None and not chunk.choices:
                usage = chunk.usage
                continue
            choice = chunk.choices[0]
            if choice.finish_reason is not None:
                finish, stop = choice.finish_reason, choice.stop_reason
            delta = choice.delta
            for kind, piece in (("thinking", delta.reasoning_content), ("text", delta.content)):
                for event in blocks.write(kind, piece):
                    yield event
            for call in delta.tool_calls or []:
                called = True
                for event in blocks.tool_use(call):
                    yield event
        for event in blocks.close():
            yield event
        if not started:  # (no output at all: cannot happen with include_usage's last chunk, but never skip it)
            yield message_start(usage or UsageInfo(prompt_tokens=run.prompt_tokens))
        reason, sequence = _stop_reason(finish, stop, called)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage=_usage(usage or UsageInfo(prompt_tokens=run.prompt_tokens)))
        yield _event("message_stop")


class _Blocks:
    """A streamed message's content blocks: thinking and text pieces go to the open block of their kind (another
    kind closes it and opens one), a tool call is a whole block of its own."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None
        """The block being written: "thinking" or "text" (None: none open)."""

    def write(self, kind: str, piece: str | None) -> list[str]:
        """Events for a piece of ``kind``'s text (none for an empty piece)."""
        if not piece:
            return []
        events = []
        if self.open_kind != kind:
            events = self.close()
            self.index, self.open_kind = self.index + 1, kind
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events.append(_event("content_block_start", index=self.index, content_block=block))
        body = {"type": "thinking_delta", "thinking": piece} if kind == "thinking" else \
            {"type": "text_delta", "text": piece}
        return [*events, _event("content_block_delta", index=self.index, delta=body)]

    def tool_use(self, call: Any) -> list[str]:
        """A tool call's block: start, its input as one JSON delta, stop."""
        events = self.close()
        self.index += 1
        block = _tool_use(call.id, call.function.name, call.function.arguments)
        return [*events, _event("content_block_start", index=self.index, content_block={**block, "input": {}}),
                _event("content_block_delta", index=self.index,
                       delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])}),
                _event("content_block_stop", index=self.index)]

    def close(self) -> list[str]:
        """The open block's stop event (none when none is open)."""
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [_event("content_block_stop", index=self.index)]


THINKING_BLOCKS = {"thinking": {"type", "thinking", "signature"}, "redacted_thinking": {"type", "data"}}
"""An earlier assistant turn's thinking blocks -> their keys (each a string, as Anthropic's replies carry them)."""


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


def _error_events(error: ErrorInfo) -> list[str]:
    """A failure after the stream began: Anthropic's error event (the status line was already sent)."""
    status = 504 if error.type == "timeout_error" else 503 if error.code == "engine_dead" else 500
    return [f"event: error\ndata: {json.dumps(anthropic_error(status, error.message))}\n\n"]


def _usage(usage: UsageInfo) -> dict[str, int]:
    """Anthropic's usage: the prompt's tokens found in the prefix cache are cache_read_input_tokens, the others
    input_tokens (Anthropic's input_tokens leaves the cached ones out: the two add up to count_tokens' figure);
    nothing is written on request (cache_control), so cache_creation_input_tokens is 0."""
    cached = min(max(usage.cached_tokens, 0), usage.prompt_tokens)
    return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _stop_reason(finish: str | None, stop: int | str | None, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish_reason, the stop string or token that ended it, and whether
    the reply called tools (a call forced by name finishes chat's reply with "stop": here it is tool_use)."""
    if called and finish == "stop":
        return "tool_use", None
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return STOP_REASONS.get(finish or "", "end_turn"), None


def _tool_use(call_id: str | None, name: str | None, arguments: str | None) -> dict[str, Any]:
    """A tool_use block of one parsed call (its arguments are a JSON object: the parsers and grammar ensure it)."""
    try:
        arguments_json = json.loads(arguments or "{}")
    except ValueError:
        arguments_json = None
    if not isinstance(arguments_json, dict):  # a model's own malformed call: its text, kept whole
        arguments_json = {"arguments": arguments}
    return {"type": "tool_use", "id": call_id or f"toolu_{uuid.uuid4().hex[:24]}", "name": name,
            "input": arguments_json}


def _blocks(reasoning: str | None, text: str | None, calls: list[tuple[str | None, str | None, str | None]]
            ) -> list[dict[str, Any]]:
    """The content blocks of a finished reply: thinking (--reasoning-parser), text, tool_use."""
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text or not calls:
        blocks.append({"type": "text", "text": text or ""})
    return blocks + [_tool_use(*call) for call in calls]


def _chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """system and messages as chat messages: tool_use blocks become an assistant's tool_calls, tool_result
    blocks tool messages (before the user's text, as Anthropic orders them); thinking blocks are dropped, as
    chat templates drop earlier turns' thinking."""
    out: list[dict[str, Any]] = []
    inline = [_text_of(m.content, f"messages[{i}].content") for i, m in enumerate(req.messages) if m.role == "system"]
    if req.system is not None or inline:  # (inline system messages merge into it, as vLLM's: chat templates
        # take a system message only first)
        out.append({"role": "system", "content": "".join([_text_of(req.system or "", "system"), *inline])})
    for i, message in enumerate(req.messages):
        if message.role == "system":
            continue
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        texts, calls, results = [], [], []
        for j, block in enumerate(message.content):
            where, kind = f"messages[{i}].content[{j}]", block.get("type")
            if kind == "text":
                check_keys(block, {"type", "text", "cache_control", "citations"}, where)
                texts.append(string_field(block, "text", where))
            elif kind == "tool_use" and message.role == "assistant":
                check_keys(block, {"type", "id", "name", "input", "cache_control"}, where)
                if not isinstance(block.get("input"), dict):
                    raise ValidationError.bad_value(f"{where}.input", block.get("input"), "an object")
                calls.append({"id": string_field(block, "id", where), "type": "function", "function": {
                    "name": string_field(block, "name", where), "arguments": json.dumps(block["input"])}})
            elif kind == "tool_result" and message.role == "user":
                check_keys(block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, where)
                content = _text_of(block.get("content", ""), f"{where}.content")
                if block.get("is_error"):  # the model is told the tool failed
                    content = f"Error: {content}"
                results.append({"role": "tool", "tool_call_id": string_field(block, "tool_use_id", where),
                                "content": content})
            elif kind in THINKING_BLOCKS and message.role == "assistant":  # checked, then dropped
                check_keys(block, THINKING_BLOCKS[kind], where)
                for key in THINKING_BLOCKS[kind] - {"type"}:
                    string_field(block, key, where)
            else:
                raise ValidationError(f"{where}: a {message.role} message's {quoted(kind)} block is not supported "
                                      "(this server takes text, tool_use from the assistant and tool_result from "
                                      "the user)",
                                      param=f"{where}.type", value=kind)
        out += results
        if texts or calls or not results:
            entry: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def _text_of(content: Any, where: str) -> str:
    """A string, or a list of text blocks, as text (``cache_control`` is taken: prefix caching is automatic)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError.bad_value(where, content, "a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else block
            raise ValidationError(f"{where}[{j}]: only text blocks are supported, got {quoted(kind)}",
                                  param=f"{where}[{j}].type", value=kind)
        check_keys(block, {"type", "text", "cache_control", "citations"}, f"{where}[{j}]")
        texts.append(string_field(block, "text", f"{where}[{j}]"))
    return "".join(texts)


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic's client tools ({name, description, input_schema}) as chat tools; server tools (web search,
    code execution, ...) are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise ValidationError(f"tools[{i}].type {quoted(tool.get('type'))} is not supported by this server (only "
                                  "client tools with an input_schema)",
                                  param=f"tools[{i}].type", value=tool.get("type"))
        check_keys(tool, {"type", "name", "description", "input_schema", "cache_control"}, f"tools[{i}]")
        function = {"name": string_field(tool, "name", f"tools[{i}]"),
                    "parameters": tool.get("input_schema", {"type": "object"})}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: dict | None) -> tuple[str | dict | None, bool]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's {"type": auto | any | tool | none}."""
    if choice is None:
        return None, True
    kind = choice.get("type")
    keys = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    check_keys(choice, keys, "tool_choice")
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ValidationError.bad_value("tool_choice", choice, "{\"type\": \"auto\" | \"any\" | \"none\"} or "
                                    "{\"type\": \"tool\", \"name\": ...}")


def _response_format(config: dict | None) -> dict | None:
    """output_config.format (Anthropic's structured outputs) as chat's response_format; an effort is refused."""
    fmt = format_field(config, "output_config", "effort")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ValidationError.bad_value("output_config.format", fmt, '{"type": "json_schema", "schema": {...}}')
    check_keys(fmt, {"type", "schema"}, "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _budget_tokens(budget: object, max_tokens: int | None) -> int:
    """thinking.budget_tokens within Anthropic's bounds: an integer of at least 1024, under max_tokens."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
        raise ValidationError.bad_value("thinking.budget_tokens", budget, "an integer >= 1024")
    if max_tokens is not None and budget >= max_tokens:
        raise ValidationError("thinking.budget_tokens must be less than max_tokens",
                              param="thinking.budget_tokens", value=budget)
    return budget


def _thinking_budget(thinking: dict | None, max_tokens: int | None) -> int | None:
    """Extended thinking, as vLLM maps it: {"type": "enabled", "budget_tokens": N} caps the reasoning at N tokens
    (chat's thinking_token_budget: it needs --reasoning-parser; Anthropic's bounds: at least 1024, under
    max_tokens); "adaptive" and "disabled" set no cap (the model's template decides). None: no cap."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind in ("adaptive", "disabled"):
        return None
    if kind != "enabled":
        raise ValidationError.bad_value("thinking.type", kind, "'enabled', 'adaptive' or 'disabled'")
    budget = _budget_tokens(thinking.get("budget_tokens"), max_tokens)
    unknown = sorted(set(thinking) - {"type", "budget_tokens", "display"})
    if unknown:
        raise ValidationError(f"thinking.{unknown[0]} is not supported", param=f"thinking.{unknown[0]}")
    return budget
