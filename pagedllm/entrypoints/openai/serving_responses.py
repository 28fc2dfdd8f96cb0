"""POST /v1/responses (and GET / DELETE of stored responses): the OpenAI Responses API as a thin mapping
onto the chat completions path.

A request becomes a ChatCompletionRequest (input items -> messages, instructions -> a system message,
text.format -> response_format, flat function tools -> chat tools) and runs through
OpenAIServingChat.start: the same template, limits, tool calling, structured outputs and reasoning
parser. Its reply (or its stream of chat chunks) is mapped back into output items and events.
"""
from __future__ import annotations

import json
import time
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ErrorInfo
from pagedllm.entrypoints.openai.protocol_responses import (ResponsesRequest, function_call_item, message_item,
                                                            new_id, output_text, reasoning_item, response_object,
                                                            usage_of)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.translate import chat_request, check_keys, format_field, renamed, string_field
from pagedllm.errors import ValidationError, quoted

PARAM_NAMES = {"messages": "input", "prompt": "input", "max_completion_tokens": "max_output_tokens",
               "max_tokens": "max_output_tokens", "response_format": "text.format", "structured_outputs": "text.format",
               "reasoning_effort": "reasoning.effort"}
"""A chat request's field -> the Responses field it was made from (an error names what the client sent)."""
METADATA_LIMITS = (16, 64, 512)
"""OpenAI's bounds on metadata: pairs, characters of a key, characters of a value."""

INPUT_ROLES = ("user", "assistant", "system", "developer")
"""The roles of a Responses input message (OpenAI's)."""


class ResponseNotFoundError(Exception):
    """GET/DELETE of an id that is not (or no longer) stored: 404."""

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id {quoted(response_id)} not found.")


ENTRY_OVERHEAD = 320
"""Bytes one stored entry holds besides its compressed JSON (its id string, the bytes object's header, its
ordered-dict slot): ~190 for a 37-character id, measured with tracemalloc, rounded up. Counted with it, so that
the bound is on the memory held."""
KEY_INDEX = "api_key_index"
"""The request state field (scope["state"]) in which the API-key middleware records which --api-key (its index)
authenticated the request: the store's scope for it."""


def owner_of(request: Request) -> int | None:
    """The store scope of a request: the index of the --api-key that authenticated it (None without keys)."""
    return request.scope.get("state", {}).get(KEY_INDEX)


class _Scope:
    """One owner's stored responses: id -> zlib-compressed JSON of [response, conversation], in LRU order."""

    def __init__(self) -> None:
        self.items: OrderedDict[str, bytes] = OrderedDict()
        self.bytes = 0


class ResponseStore:
    """Stored responses (``store: true``) for GET, DELETE and ``previous_response_id``, each in the scope of the
    API key that made it (one scope without keys): another key's id is as unknown as one never stored.

    Each is held as zlib-compressed JSON, decoded on use, so ``bytes`` is what the store holds (not an estimate
    of Python objects several times larger). Each of ``scopes`` keys gets an equal share of ``max_count`` and
    ``max_bytes``: a key's requests evict only its own responses, least recently used first, and all of them
    together stay within the totals."""

    def __init__(self, max_count: int, max_bytes: int, scopes: int = 1) -> None:
        assert scopes >= 1
        self.max_count, self.max_bytes = max(1, max_count // scopes), max(1, max_bytes // scopes)
        """One scope's share."""
        self.num_scopes = scopes
        self._scopes: dict[int | None, _Scope] = {}

    def put(self, response: dict, conversation: list[dict], owner: int | None = None) -> None:
        """Store a finished response with the conversation that continues from it (its input and output as
        chat messages) in ``owner``'s scope; one larger than the whole share is not kept."""
        # level 1: most of the ratio of higher levels on text, at several times the speed (on the event loop)
        blob = zlib.compress(json.dumps([response, conversation], ensure_ascii=False)
                             .encode("utf-8", "surrogatepass"), 1)
        if len(blob) + ENTRY_OVERHEAD > self.max_bytes:
            return
        scope = self._scopes.setdefault(owner, _Scope())
        assert owner is None or 0 <= owner < self.num_scopes, owner
        self.delete(response["id"], owner)
        scope.items[response["id"]] = blob
        scope.bytes += len(blob) + ENTRY_OVERHEAD
        while len(scope.items) > self.max_count or scope.bytes > self.max_bytes:
            _, dropped = scope.items.popitem(last=False)
            scope.bytes -= len(dropped) + ENTRY_OVERHEAD

    def get(self, response_id: str, owner: int | None = None) -> tuple[dict, list[dict]] | None:
        """(the response, its conversation) if ``owner`` stored it, else None; a hit counts as a use."""
        scope = self._scopes.get(owner)
        blob = None if scope is None else scope.items.get(response_id)
        if blob is None:
            return None
        scope.items.move_to_end(response_id)
        response, conversation = json.loads(zlib.decompress(blob))
        return response, conversation

    def delete(self, response_id: str, owner: int | None = None) -> bool:
        """Drop ``owner``'s response of this id; whether there was one."""
        scope = self._scopes.get(owner)
        blob = None if scope is None else scope.items.pop(response_id, None)
        if blob is not None:
            scope.bytes -= len(blob) + ENTRY_OVERHEAD
        return blob is not None

    @property
    def bytes(self) -> int:
        """Bytes held by every scope together (compressed JSON plus ENTRY_OVERHEAD per entry)."""
        return sum(scope.bytes for scope in self._scopes.values())

    def __len__(self) -> int:
        return sum(len(scope.items) for scope in self._scopes.values())


class OpenAIServingResponses:
    """The Responses API over a chat server's request path."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        owner = owner_of(raw)
        conversation = self._conversation(req, owner)
        chat_req = self._chat_request(req, conversation)
        try:
            run = await self.chat.start(chat_req, raw)
        except ValidationError as e:
            raise renamed(e, PARAM_NAMES) from None
        if run is None:
            return Response(status_code=499)  # the client went away while its request was prepared
        response_id, created = new_id("resp"), int(time.time())
        if req.stream:
            writer = _EventWriter()  # one numbering for the events and a failure's events after them
            events = self._events(req, run, chat_req, response_id, created, conversation, writer, owner)
            failed = self._error_events(req, run.model, response_id, created, writer)
            return StreamingResponse(self.chat.with_error_events(events, failed), media_type="text/event-stream")
        completion = await self.chat.response(run, raw)
        if completion is None:
            return Response(status_code=499)
        choice = completion.choices[0]
        message = choice.message
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
        output = _output(message.reasoning_content, message.content, calls)
        response = response_object(response_id, req, run.model, created, output, _status(choice.finish_reason),
                                   usage_of(completion.usage))
        self._keep(req, response, conversation, owner)
        return JSONResponse(response)

    def get(self, response_id: str, raw: Request) -> dict:
        """GET /v1/responses/{id}: a response the request's API key stored (404 for any other id)."""
        found = self.store.get(response_id, owner_of(raw))
        if found is None:
            raise ResponseNotFoundError(response_id)
        return found[0]

    def delete(self, response_id: str, raw: Request) -> dict:
        """DELETE /v1/responses/{id}: drop a response the request's API key stored (404 for any other id)."""
        if not self.store.delete(response_id, owner_of(raw)):
            raise ResponseNotFoundError(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def _keep(self, req: ResponsesRequest, response: dict, conversation: list[dict], owner: int | None) -> None:
        if req.store:
            self.store.put(response, conversation + _as_messages(response["output"]), owner)

    def _conversation(self, req: ResponsesRequest, owner: int | None) -> list[dict]:
        """The conversation so far as chat messages: the previous response's (its input and output, not its
        instructions, as OpenAI; only one stored by ``owner``), then this input."""
        earlier: list[dict] = []
        if req.previous_response_id is not None:
            found = self.store.get(req.previous_response_id, owner)
            if found is None:
                raise ValidationError(f"Previous response with id {quoted(req.previous_response_id)} not found (it was "
                                      "not stored, was deleted, or the server's response store dropped it)",
                                      param="previous_response_id", value=req.previous_response_id)
            earlier = found[1]
        return earlier + _input_messages(req.input)

    def _chat_request(self, req: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
        """The chat completion request this Responses request maps onto (400 naming what cannot be)."""
        _refuse_unsupported(req)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) + \
            conversation
        fields: dict[str, Any] = {
            "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "stream": req.stream,
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text),
            "tools": _chat_tools(req.tools), "tool_choice": _chat_tool_choice(req.tool_choice), "user": req.user,
            "reasoning_effort": (req.reasoning or {}).get("effort"), "thinking_token_budget": req.thinking_token_budget,
            "include_reasoning": req.include_reasoning}
        if req.stream:
            fields["stream_options"] = {"include_usage": True}
        return chat_request(fields, PARAM_NAMES)

    async def _events(self, req: ResponsesRequest, run: Any, chat_req: ChatCompletionRequest, response_id: str,
                      created: int, conversation: list[dict], events: "_EventWriter",
                      owner: int | None) -> AsyncIterator[str]:
        """The SDK's event sequence, from the chat chunks as they come."""
        state = response_object(response_id, req, run.model, created, [], "in_progress")
        yield events.send("response.created", response=state)
        yield events.send("response.in_progress", response=state)
        output: list[dict] = []
        open_item: dict | None = None  # the reasoning or message item being written
        finish, usage = None, None

        def close() -> list[str]:
            nonlocal open_item
            if open_item is None:
                return []
            item, open_item = open_item, None
            return events.close_item(item, len(output) - 1)

        async for chunk in self.chat.chunks(run, chat_req):
            if chunk.usage is not None and not chunk.choices:
                usage = chunk.usage
                continue
            choice = chunk.choices[0]
            delta = choice.delta
            finish = choice.finish_reason or finish
            for kind, piece in (("reasoning", delta.reasoning_content), ("message", delta.content)):
                if not piece:
                    continue
                if open_item is None or open_item["type"] != kind:
                    for event in close():
                        yield event
                    open_item = (reasoning_item(new_id("rs"), "", "in_progress") if kind == "reasoning"
                                 else message_item(new_id("msg"), None, "in_progress"))
                    output.append(open_item)
                    for event in events.open_item(open_item, len(output) - 1):
                        yield event
                yield events.delta(open_item, len(output) - 1, piece)
            for call in delta.tool_calls or []:
                for event in close():
                    yield event
                item = function_call_item(new_id("fc"), call.id, call.function.name, call.function.arguments)
                output.append(item)
                for event in events.function_call(item, len(output) - 1):
                    yield event
        for event in close():
            yield event
        if not output:  # an empty reply is still one (empty) message, as in the non-streamed answer
            output.append(message_item(new_id("msg"), None, "in_progress"))
            for event in events.open_item(output[-1], 0) + events.close_item(output[-1], 0):
                yield event
        status = _status(finish)
        response = response_object(response_id, req, run.model, created, output, status, usage_of(usage))
        self._keep(req, response, conversation, owner)
        yield events.send("response.completed" if status == "completed" else "response.incomplete",
                          response=response)

    @staticmethod
    def _error_events(req: ResponsesRequest, model: str, response_id: str, created: int,
                      writer: "_EventWriter") -> Callable[[ErrorInfo], list[str]]:
        """A failure after the stream began: response.failed, then an error event (the status line was sent)."""
        def events(error: ErrorInfo) -> list[str]:
            failed = response_object(response_id, req, model, created, [], "failed",
                                     error={"code": error.code or "server_error", "message": error.message})
            return [writer.send("response.failed", response=failed),
                    writer.send("error", code=error.code, message=error.message, param=None)]
        return events


class _EventWriter:
    """Server-sent events of the Responses stream, numbered in order (sequence_number)."""

    def __init__(self, sequence: int = 0) -> None:
        self.sequence = sequence

    def send(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def open_item(self, item: dict, index: int) -> list[str]:
        events = [self.send("response.output_item.added", output_index=index, item=_snapshot(item))]
        part = {"type": "reasoning_text", "text": ""} if item["type"] == "reasoning" else output_text("")
        events.append(self.send("response.content_part.added", item_id=item["id"], output_index=index,
                                content_index=0, part=part))
        return events

    def delta(self, item: dict, index: int, piece: str) -> str:
        if item["type"] == "reasoning":
            if not item["content"]:
                item["content"].append({"type": "reasoning_text", "text": ""})
            item["content"][0]["text"] += piece
            return self.send("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                             content_index=0, delta=piece)
        if not item["content"]:
            item["content"].append(output_text(""))
        item["content"][0]["text"] += piece
        return self.send("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                         delta=piece, logprobs=[])

    def close_item(self, item: dict, index: int) -> list[str]:
        if not item["content"]:
            item["content"].append({"type": "reasoning_text", "text": ""} if item["type"] == "reasoning"
                                   else output_text(""))
        part = item["content"][0]
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        item["status"] = "completed"
        return [self.send(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra),
                self.send("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part),
                self.send("response.output_item.done", output_index=index, item=item)]

    def function_call(self, item: dict, index: int) -> list[str]:
        added = {**item, "arguments": "", "status": "in_progress"}
        return [self.send("response.output_item.added", output_index=index, item=added),
                self.send("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=item["arguments"]),
                self.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=item["name"], arguments=item["arguments"]),
                self.send("response.output_item.done", output_index=index, item=item)]


def _snapshot(item: dict) -> dict:
    """An item as first announced: in progress, no content yet."""
    return {**item, "content": [], "status": "in_progress"}


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _output(reasoning: str | None, content: str | None, calls: list[tuple[str | None, str, str]]) -> list[dict]:
    """The output items of a finished reply: its reasoning, its message (always, unless it only called tools),
    its function calls."""
    items = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning))
    if content or not calls:
        items.append(message_item(new_id("msg"), content or ""))
    items += [function_call_item(new_id("fc"), call_id or new_id("call"), name, arguments)
              for call_id, name, arguments in calls]
    return items


def _as_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a following turn continues from (reasoning is left out,
    as chat templates drop earlier turns' thinking)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _input_messages(value: str | list[dict]) -> list[dict]:
    """Responses input (a string, or items: messages, function_call, function_call_output, reasoning) as chat
    messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ValidationError.bad_value(f"input[{i}]", item, "an input item (an object)")
        kind = item.get("type", "message")
        if kind == "message":
            _check_item(item, {"type", "role", "content", "id", "status"}, f"input[{i}]")
            if item.get("role") not in INPUT_ROLES:  # (OpenAI's Responses roles; chat alone passes custom ones on)
                raise ValidationError.bad_value(f"input[{i}].role", item.get("role"), f"one of {list(INPUT_ROLES)}")
            messages.append({"role": item.get("role"), "content": _text_of(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            _check_item(item, {"type", "call_id", "name", "arguments", "id", "status"}, f"input[{i}]")
            call = {"id": string_field(item, "call_id", f"input[{i}]"), "type": "function",
                    "function": {"name": string_field(item, "name", f"input[{i}]"),
                                 "arguments": string_field(item, "arguments", f"input[{i}]")}}
            if messages and messages[-1]["role"] == "assistant":  # calls of one turn go in one message
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            _check_item(item, {"type", "call_id", "output", "id", "status"}, f"input[{i}]")
            messages.append({"role": "tool", "tool_call_id": string_field(item, "call_id", f"input[{i}]"),
                             "content": _text_of(item.get("output"), f"input[{i}].output")})
        elif kind == "reasoning":  # checked, then left out: chat templates drop earlier turns' thinking too
            _check_item(item, {"type", "id", "summary", "content", "encrypted_content", "status"}, f"input[{i}]")
            _check_parts(item.get("summary", []), {"summary_text": {"type", "text"}}, f"input[{i}].summary")
            _check_parts(item.get("content") or [], {"reasoning_text": {"type", "text"}}, f"input[{i}].content")
            if item.get("encrypted_content") is not None:
                string_field(item, "encrypted_content", f"input[{i}]")
        else:
            raise ValidationError(f"input[{i}].type {quoted(kind)} is not supported (this server takes message, "
                                  "function_call, function_call_output and reasoning items)",
                                  param=f"input[{i}].type", value=kind)
    return messages


ITEM_STATUSES = ("in_progress", "completed", "incomplete")
"""An input item's status (as the API's own items carry it)."""
TEXT_PARTS = {"input_text": {"type", "text"}, "output_text": {"type", "text", "annotations", "logprobs"},
              "text": {"type", "text"}}
"""The text content parts a message item takes -> their keys."""


def _check_item(item: dict, keys: set[str], where: str) -> None:
    """An input item's keys within ``keys``, its id a string and its status one of ITEM_STATUSES (400 naming the
    field)."""
    check_keys(item, keys, where)
    if item.get("id") is not None:
        string_field(item, "id", where)
    if item.get("status") is not None and item["status"] not in ITEM_STATUSES:
        raise ValidationError.bad_value(f"{where}.status", item["status"], f"one of {list(ITEM_STATUSES)}")


def _check_parts(parts: Any, kinds: dict[str, set[str]], where: str) -> list[str]:
    """A list of text parts, each of a type in ``kinds`` with only that type's keys and a string text (400 naming
    the field); their texts."""
    if not isinstance(parts, list):
        raise ValidationError.bad_value(where, parts, "a list of parts")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise ValidationError(f"{where}[{j}]: only {', '.join(kinds)} parts are supported, got {quoted(kind)}",
                                  param=f"{where}[{j}]", value=kind)
        check_keys(part, kinds[kind], f"{where}[{j}]")
        for name in ("annotations", "logprobs"):  # what our own output_text parts carry: lists, else refused
            if part.get(name) is not None and not isinstance(part[name], list):
                raise ValidationError.bad_value(f"{where}[{j}].{name}", part[name], "a list")
        texts.append(string_field(part, "text", f"{where}[{j}]"))
    return texts


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string, or input_text / output_text parts) as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError.bad_value(f"{where}.content", content, "a string or a list of text parts")
    return "".join(_check_parts(content, TEXT_PARTS, f"{where}.content"))


def _refuse_unsupported(req: ResponsesRequest) -> None:
    """Known fields whose other values we cannot honour: 400 naming them, never silently ignored."""
    if req.background:
        raise ValidationError("background responses are not supported by this server", param="background")
    if req.reasoning:  # effort goes to the chat template (as vLLM: reasoning_effort, enable_thinking)
        check_keys(req.reasoning, {"effort", "summary", "generate_summary"}, "reasoning")
        for name in ("summary", "generate_summary"):
            if req.reasoning.get(name) is not None:
                raise ValidationError(f"reasoning.{name} is not supported by this server (it writes no reasoning "
                                      "summaries; the model's own reasoning comes back as reasoning items with "
                                      "--reasoning-parser)", param=f"reasoning.{name}", value=req.reasoning[name])
    if req.include:
        raise ValidationError(f"include {quoted(req.include[0])} is not supported by this server", param="include")
    if req.truncation == "auto":
        raise ValidationError("truncation 'auto' is not supported by this server (a conversation over "
                              "max_model_len is refused)", param="truncation")
    pairs, key_chars, value_chars = METADATA_LIMITS
    if req.metadata is not None:
        if len(req.metadata) > pairs:
            raise ValidationError(f"metadata has {len(req.metadata)} pairs; at most {pairs}", param="metadata")
        for k, v in req.metadata.items():
            if len(k) > key_chars or len(v) > value_chars:
                raise ValidationError(f"metadata keys take at most {key_chars} characters and values {value_chars}",
                                      param=f"metadata.{k[:key_chars]}")


def _response_format(text: dict | None) -> dict | None:
    """text.format as chat's response_format."""
    fmt = format_field(text, "text", "verbosity")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValidationError.bad_value("text.format", fmt, "an object")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        check_keys(fmt, {"type"}, "text.format")
        return {"type": kind}
    if kind == "json_schema":
        check_keys(fmt, {"type", "name", "schema", "description", "strict"}, "text.format")
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise ValidationError.bad_value("text.format.type", kind, "'text', 'json_object' or 'json_schema'")


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools as chat tools; built-in tools (web search, files, ...) are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise ValidationError(f"tools[{i}].type {quoted(kind)} is not supported by this server (only function "
                                  "tools; built-in tools such as web search run on OpenAI's side)",
                                  param=f"tools[{i}].type", value=kind)
        check_keys(tool, {"type", "name", "description", "parameters", "strict"}, f"tools[{i}]")
        string_field(tool, "name", f"tools[{i}]")
        function = {k: v for k, v in tool.items() if k in ("name", "description", "parameters") and v is not None}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    """Responses' tool_choice ({"type": "function", "name": ...} for a named one) as chat's."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        check_keys(choice, {"type", "name"}, "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValidationError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": "
                          f"...}} (built-in tool choices are not supported), got {quoted(choice)}", param="tool_choice")
