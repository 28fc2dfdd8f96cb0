"""POST /v1/responses (and GET / DELETE of stored responses, cancel of background ones): the OpenAI Responses
API as a thin mapping onto the chat completions path.

A request becomes a ChatCompletionRequest (input items -> messages, instructions -> a system message,
text.format -> response_format, function tools and namespace tools' functions -> chat tools) and runs through
OpenAIServingChat.start: the same template, limits, tool calling, structured outputs and reasoning
parser. Its reply (or its stream of chat chunks) is mapped back into output items and events. A ``background``
one is awaited by a task of its own (its events kept while it runs, when streamed) that stores the result: GET
polls it (or follows its events again), cancel aborts it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse, ErrorInfo
from pagedllm.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    function_call_item,
    message_item,
    new_id,
    output_text,
    reasoning_item,
    response_object,
    usage_of,
)
from pagedllm.entrypoints.openai.serving import LATE_FAILURES, OverloadedError, late_failure
from pagedllm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pagedllm.entrypoints.openai.translate import chat_request, check_keys, format_field, renamed, string_field
from pagedllm.errors import ValidationError, quoted

PARAM_NAMES = {"messages": "input", "prompt": "input", "max_completion_tokens": "max_output_tokens",
               "max_tokens": "max_output_tokens", "response_format": "text.format", "structured_outputs": "text.format",
               "reasoning_effort": "reasoning.effort", "logprobs": "include"}
"""A chat request's field -> the Responses field it was made from (an error names what the client sent)."""
METADATA_LIMITS = (16, 64, 512)
"""OpenAI's bounds on metadata: pairs, characters of a key, characters of a value."""

INPUT_ROLES = ("user", "assistant", "system", "developer")
"""The roles of a Responses input message (OpenAI's)."""


logger = logging.getLogger("pagedllm.server")


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


@dataclass
class _Running:
    """A background response being generated: its API key's index, the response as queued, the conversation it is
    stored with, its events so far (streamed; None otherwise) and its task."""

    owner: int | None
    response: dict
    conversation: list[dict]
    events: list[str] | None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when an event is added, and when the task ends."""
    task: asyncio.Task | None = None


def _check_starting_after(stream: bool, starting_after: int | None) -> None:
    """GET's starting_after: a sequence number (at least 0), with stream=true only."""
    if starting_after is not None and (not stream or starting_after < 0):
        raise ValidationError("starting_after needs stream=true" if not stream else
                              f"starting_after must be a sequence number (at least 0), got {starting_after}",
                              param="starting_after", value=starting_after)


async def _follow(running: _Running, after: int | None) -> AsyncIterator[str]:
    """A streamed background response's events after sequence number ``after`` (all of them: None), then each as
    it comes, until it ends (a client that stops reading stops only this)."""
    assert running.events is not None and running.task is not None
    index = 0 if after is None else after + 1
    while True:
        running.changed.clear()
        while index < len(running.events):
            yield running.events[index]
            index += 1
        if running.task.done():
            return
        await running.changed.wait()


MAX_BACKGROUND_RESPONSES = 1024
"""Background responses running at once (a plain request holds its connection, which --limit-concurrency and the
per-client connection cap bound; a background one does not): past it, a 503 "overloaded"."""


class OpenAIServingResponses:
    """The Responses API over a chat server's request path."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store
        self._running: dict[str, _Running] = {}
        """The background responses still being generated, by id."""
        self.max_background = MAX_BACKGROUND_RESPONSES

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        if req.background and len(self._running) >= self.max_background:  # before anything is prepared
            raise OverloadedError(f"{self.max_background} background responses are running: retry when one is done "
                                  "(background)")
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
        if req.background:
            return self._background(req, run, chat_req, response_id, created, conversation, owner)
        if req.stream:
            writer = _EventWriter()  # one numbering for the events and a failure's events after them
            events = self._events(req, run, chat_req, response_id, created, conversation, writer, owner)
            failed = self._error_events(req, run.model, response_id, created, writer)
            return StreamingResponse(self.chat.with_error_events(events, failed), media_type="text/event-stream")
        completion = await self.chat.response(run, raw)
        if completion is None:
            return Response(status_code=499)
        response = self._finished(req, run.model, response_id, created, completion)
        self._keep(req, response, conversation, owner)
        return JSONResponse(response)

    @staticmethod
    def _finished(req: ResponsesRequest, model: str, response_id: str, created: int,
                  completion: ChatCompletionResponse) -> dict:
        """The Response object of a finished chat reply."""
        choice = completion.choices[0]
        message = choice.message
        calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
        logprobs = _logprobs_json(choice.logprobs)
        output = _output(message.reasoning_content, message.content, calls, _namespaced(req.tools), logprobs)
        return response_object(response_id, req, model, created, output, _status(choice.finish_reason),
                               usage_of(completion.usage))

    def _background(self, req: ResponsesRequest, run: ChatRun, chat_req: ChatCompletionRequest, response_id: str,
                    created: int, conversation: list[dict], owner: int | None) -> Response:
        """``background: true``: the request is queued in the engine and answered at once with the response,
        status "queued" (stored: GET polls it); a task stores the finished response (or a failed one) in its
        place, unless it was cancelled first. Streamed, its events are kept while it runs: this answer follows
        them, and so does GET ?stream=true (from ``starting_after``); a client that goes away leaves it running."""
        queued = response_object(response_id, req, run.model, created, [], "queued")
        self.store.put(queued, conversation, owner)
        running = _Running(owner, queued, conversation, [] if req.stream else None)
        writer = _EventWriter()
        failed_events = self._error_events(req, run.model, response_id, created, writer)

        def failed(error: ErrorInfo) -> list[str]:
            self._fail(queued, error, conversation, owner)
            return failed_events(error)

        async def finish() -> None:
            try:
                if running.events is not None:
                    events = self._events(req, run, chat_req, response_id, created, conversation, writer, owner)
                    async for event in self.chat.with_error_events(events, failed):
                        running.events.append(event)
                        running.changed.set()
                else:
                    completion = await self.chat.response(run, None)
                    assert completion is not None  # (no client to go away)
                    self._keep(req, self._finished(req, run.model, response_id, created, completion),
                               conversation, owner)
            except LATE_FAILURES as e:
                failed(late_failure(e))
            except Exception as e:  # a bug of ours: the response says so instead of staying queued for ever
                logger.exception("background response %s failed", response_id)
                events = failed(ErrorInfo(message=f"{type(e).__name__}: {e}", type="server_error",
                                          code="server_error"))
                if running.events is not None:
                    running.events += events
            finally:
                running.changed.set()

        running.task = asyncio.create_task(finish(), name=f"background {response_id}")
        self._running[response_id] = running
        running.task.add_done_callback(lambda _: self._running.pop(response_id, None))
        if running.events is not None:
            return StreamingResponse(_follow(running, None), media_type="text/event-stream")
        return JSONResponse(queued)

    async def close(self) -> None:
        """Cancel every background response still running (the server is stopping)."""
        for response_id, running in list(self._running.items()):
            await self._stop(response_id, running.owner)

    def _fail(self, response: dict, error: ErrorInfo, conversation: list[dict], owner: int | None) -> None:
        self.store.put({**response, "status": "failed", "error": {"code": error.code or "server_error",
                                                                  "message": error.message}}, conversation, owner)

    async def _stop(self, response_id: str, owner: int | None) -> dict | None:
        """Cancel ``owner``'s background response of this id if it is still running (its engine request aborted);
        the cancelled response, stored in its place (None: no such response is running)."""
        running = self._running.get(response_id)
        if running is None or running.owner != owner or running.task is None or running.task.done():
            return None
        running.task.cancel()
        await asyncio.wait([running.task])  # (its streams are aborted once it has ended)
        cancelled = {**running.response, "status": "cancelled"}
        self.store.put(cancelled, running.conversation, owner)
        return cancelled

    async def cancel(self, response_id: str, raw: Request) -> dict:
        """POST /v1/responses/{id}/cancel: stop a background response of the request's API key that is still
        running (its engine request aborted, its status "cancelled"); one already cancelled is returned as it is;
        a finished one, or one made without background, is a 400 (404 for an id not stored)."""
        owner = owner_of(raw)
        cancelled = await self._stop(response_id, owner)
        if cancelled is not None:
            return cancelled
        found = self.store.get(response_id, owner)
        if found is None:
            raise ResponseNotFoundError(response_id)
        response = found[0]
        if not response.get("background"):
            raise ValidationError("Cannot cancel a synchronous response. (only responses created with background "
                                  "true can be cancelled)", param="response_id", value=response_id)
        if response["status"] != "cancelled":
            raise ValidationError(f"Cannot cancel a response that is already {response['status']}.",
                                  param="response_id", value=response_id)
        return response

    def get(self, response_id: str, raw: Request, stream: bool = False,
            starting_after: int | None = None) -> dict | Response:
        """GET /v1/responses/{id}: a response the request's API key stored (404 for any other id). ``stream``: the
        events of a streamed background response still running, those after ``starting_after`` (a sequence
        number) first; a 400 for any other response (GET it without stream)."""
        owner = owner_of(raw)
        _check_starting_after(stream, starting_after)
        running = self._running.get(response_id) if stream else None
        if running is not None and running.owner == owner and running.events is not None:
            return StreamingResponse(_follow(running, starting_after), media_type="text/event-stream")
        found = self.store.get(response_id, owner)
        if found is None:
            raise ResponseNotFoundError(response_id)
        if stream:
            raise ValidationError(f"Response with id {quoted(response_id)} is not streaming: only a background "
                                  "response created with stream true can be streamed again, while it runs (this one "
                                  f"is {found[0]['status']}; GET it without stream)", param="stream")
        return found[0]

    async def delete(self, response_id: str, raw: Request) -> dict:
        """DELETE /v1/responses/{id}: drop a response the request's API key stored, a background one still
        running cancelled first (404 for any other id)."""
        await self._stop(response_id, owner_of(raw))
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
            if found[0]["status"] in ("queued", "in_progress"):
                raise ValidationError(f"Previous response with id {quoted(req.previous_response_id)} is still "
                                      f"{found[0]['status']} (a background response: retrieve it until it is done)",
                                      param="previous_response_id", value=req.previous_response_id)
            earlier = found[1]
        return earlier + _input_messages(req.input)

    async def render(self, req: ResponsesRequest) -> dict[str, Any]:
        """vLLM's /v1/responses/render: the /inference/v1/generate request of the chat request ``req`` maps onto
        (serving_render.py), nothing run or stored; its id ``resp_...``. The conversation is the request's own
        input: a stored response is not read (previous_response_id is a 400, as vLLM; so is background)."""
        from pagedllm.entrypoints.openai.serving_render import render_chat

        for name in ("previous_response_id", "background"):
            if getattr(req, name):
                raise ValidationError(f"{name} cannot be rendered: a render reads no stored response and runs "
                                      "nothing (send the whole conversation as input)", param=name,
                                      value=getattr(req, name))
        chat_req = self._chat_request(req, _input_messages(req.input))
        try:
            generate = await render_chat(self.chat, chat_req)
        except ValidationError as e:
            raise renamed(e, PARAM_NAMES) from None
        return {**generate, "request_id": new_id("resp")}

    def _chat_request(self, req: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
        """The chat completion request this Responses request maps onto (400 naming what cannot be)."""
        _refuse_unsupported(req)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) + \
            conversation
        fields: dict[str, Any] = {
            "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "stream": req.stream,
            "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req.text),
            "tools": _chat_tools(req.tools), "tool_choice": _chat_tool_choice(req.tool_choice, req.tools),
            "user": req.user, "reasoning_effort": (req.reasoning or {}).get("effort"),
            "thinking_token_budget": req.thinking_token_budget, "include_reasoning": req.include_reasoning,
            "chat_template_kwargs": req.chat_template_kwargs}
        if OUTPUT_LOGPROBS in (req.include or []):
            fields.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
        if req.stream:
            fields["stream_options"] = {"include_usage": True}
        return chat_request(fields, PARAM_NAMES)

    async def _events(self, req: ResponsesRequest, run: Any, chat_req: ChatCompletionRequest, response_id: str,
                      created: int, conversation: list[dict], events: _EventWriter,
                      owner: int | None) -> AsyncIterator[str]:
        """The SDK's event sequence, from the chat chunks as they come."""
        state = response_object(response_id, req, run.model, created, [], "in_progress")
        yield events.send("response.created", response=state)
        yield events.send("response.in_progress", response=state)
        output: list[dict] = []
        open_item: dict | None = None  # the reasoning or message item being written
        finish, usage = None, None
        namespaced = _namespaced(req.tools)
        logprobs: list[dict] = []  # of tokens not yet sent: they go with the next output_text delta (as the
        # whole reply's go on its message: a reasoning token's too)

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
            logprobs += _logprobs_json(choice.logprobs) or []
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
                yield events.delta(open_item, len(output) - 1, piece, logprobs if kind == "message" else None)
                if kind == "message":
                    logprobs = []
            for call in delta.tool_calls or []:
                for event in close():
                    yield event
                item = _call_item(call.id, call.function.name, call.function.arguments, namespaced)
                output.append(item)
                for event in events.function_call(item, len(output) - 1):
                    yield event
        if logprobs and open_item is not None and open_item["type"] == "message":  # tokens of no text (the last)
            open_item["content"][0]["logprobs"] += logprobs
        for event in close():
            yield event
        response = response_object(response_id, req, run.model, created, output, _status(finish), usage_of(usage))
        for event in self._last_events(req, response, conversation, events, owner):
            yield event

    def _last_events(self, req: ResponsesRequest, response: dict, conversation: list[dict], events: _EventWriter,
                     owner: int | None) -> list[str]:
        """The stream's end: an empty reply's one (empty) message, as in the non-streamed answer, then
        response.completed (or .incomplete); the response is stored (store=true) first."""
        sent = []
        output = response["output"]
        if not output:
            output.append(message_item(new_id("msg"), None, "in_progress"))
            sent = events.open_item(output[-1], 0) + events.close_item(output[-1], 0)
        self._keep(req, response, conversation, owner)
        status = response["status"]
        return [*sent, events.send("response.completed" if status == "completed" else "response.incomplete",
                                   response=response)]

    @staticmethod
    def _error_events(req: ResponsesRequest, model: str, response_id: str, created: int,
                      writer: _EventWriter) -> Callable[[ErrorInfo], list[str]]:
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

    def delta(self, item: dict, index: int, piece: str, logprobs: list[dict] | None = None) -> str:
        """A reasoning_text or output_text delta (``logprobs``: the output_text's tokens since the last one)."""
        if item["type"] == "reasoning":
            if not item["content"]:
                item["content"].append({"type": "reasoning_text", "text": ""})
            item["content"][0]["text"] += piece
            return self.send("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                             content_index=0, delta=piece)
        if not item["content"]:
            item["content"].append(output_text(""))
        item["content"][0]["text"] += piece
        item["content"][0]["logprobs"] += logprobs or []
        return self.send("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                         delta=piece, logprobs=logprobs or [])

    def close_item(self, item: dict, index: int) -> list[str]:
        if not item["content"]:
            item["content"].append({"type": "reasoning_text", "text": ""} if item["type"] == "reasoning"
                                   else output_text(""))
        part = item["content"][0]
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": part["logprobs"]}
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


def _output(reasoning: str | None, content: str | None, calls: list[tuple[str | None, str, str]],
            namespaced: dict[str, tuple[str, str]], logprobs: list[dict] | None = None) -> list[dict]:
    """The output items of a finished reply: its reasoning, its message (always, unless it only called tools;
    ``logprobs``: the reply's tokens', on its output_text as vLLM), its function calls (``namespaced``: the flat
    names of namespace tools' functions, see _namespaced)."""
    items = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning))
    if content or not calls:
        items.append(message_item(new_id("msg"), content or "", logprobs=logprobs))
    items += [_call_item(call_id, name, arguments, namespaced) for call_id, name, arguments in calls]
    return items


def _logprobs_json(logprobs: Any) -> list[dict] | None:
    """Chat's logprobs of a reply (or of a chunk) as the Responses API's output_text logprobs (the same shape:
    token, logprob, bytes, top_logprobs)."""
    if logprobs is None or not logprobs.content:
        return None
    return [entry.model_dump() for entry in logprobs.content]


def _as_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a following turn continues from (reasoning is left out,
    as chat templates drop earlier turns' thinking)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": _flat_name(item, "output"), "arguments": item["arguments"]}}
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
            _check_item(item, {"type", "call_id", "name", "namespace", "arguments", "id", "status"}, f"input[{i}]")
            call = {"id": string_field(item, "call_id", f"input[{i}]"), "type": "function",
                    "function": {"name": _flat_name(item, f"input[{i}]"),
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


OUTPUT_LOGPROBS = "message.output_text.logprobs"
"""The one ``include`` value we honour: the output tokens' logprobs (chat's logprobs, top_logprobs alternatives)."""
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
    if req.background and not req.store:
        raise ValidationError("background can only be used when `store` is true (a background response is "
                              "retrieved from the store)", param="background")
    if req.reasoning:  # effort goes to the chat template (as vLLM: reasoning_effort, enable_thinking)
        check_keys(req.reasoning, {"effort", "summary", "generate_summary"}, "reasoning")
        for name in ("summary", "generate_summary"):
            if req.reasoning.get(name) is not None:
                raise ValidationError(f"reasoning.{name} is not supported by this server (it writes no reasoning "
                                      "summaries; the model's own reasoning comes back as reasoning items with "
                                      "--reasoning-parser)", param=f"reasoning.{name}", value=req.reasoning[name])
    for name in req.include or []:
        if name != OUTPUT_LOGPROBS:
            raise ValidationError(f"include {quoted(name)} is not supported by this server (only "
                                  f"{quoted(OUTPUT_LOGPROBS)})", param="include")
    if req.top_logprobs is not None and OUTPUT_LOGPROBS not in (req.include or []):
        raise ValidationError(f"top_logprobs needs include [{quoted(OUTPUT_LOGPROBS)}] (the logprobs come back "
                              "only then)", param="top_logprobs", value=req.top_logprobs)
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


NAMESPACE_SEPARATOR = "__"
"""A namespace tool's function is shown to the model (and called by it) as ``<namespace>__<name>``, as vLLM; its
function_call items carry ``name`` and ``namespace`` apart again."""


def _chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools, and the functions of namespace tools (named ``<namespace>__<name>``), as
    chat tools; built-in tools (web search, files, ...) are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind == "namespace":
            check_keys(tool, {"type", "name", "description", "tools"}, f"tools[{i}]")
            namespace = string_field(tool, "name", f"tools[{i}]")
            about = tool.get("description")
            if about is not None:
                string_field(tool, "description", f"tools[{i}]")
            inner = tool.get("tools")
            if not isinstance(inner, list) or not inner:
                raise ValidationError.bad_value(f"tools[{i}].tools", inner, "a non-empty list of function tools")
            out += [_chat_function(fn, f"tools[{i}].tools[{j}]", namespace, about) for j, fn in enumerate(inner)]
        elif kind == "function":
            out.append(_chat_function(tool, f"tools[{i}]"))
        else:
            raise ValidationError(f"tools[{i}].type {quoted(kind)} is not supported by this server (only function "
                                  "and namespace tools; built-in tools such as web search run on OpenAI's side)",
                                  param=f"tools[{i}].type", value=kind)
    return out


def _chat_function(tool: Any, where: str, namespace: str | None = None, about: str | None = None) -> dict:
    """One function tool as a chat tool; in a namespace, named ``<namespace>__<name>``, its description after the
    namespace's (``about``: the model is shown both)."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise ValidationError(f"{where}.type {quoted(kind)} is not supported by this server (a namespace holds "
                              "function tools)", param=f"{where}.type", value=kind)
    check_keys(tool, {"type", "name", "description", "parameters", "strict"}, where)
    name = string_field(tool, "name", where)
    function = {k: v for k, v in tool.items() if k in ("description", "parameters") and v is not None}
    if namespace is None:
        return {"type": "function", "function": {"name": name, **function}}
    if about:
        function["description"] = f"{about}\n{function['description']}" if function.get("description") else about
    return {"type": "function", "function": {"name": f"{namespace}{NAMESPACE_SEPARATOR}{name}", **function}}


def _namespaced(tools: list[dict] | None) -> dict[str, tuple[str, str]]:
    """The flat name of each function of the request's namespace tools -> (its namespace, its own name)."""
    names: dict[str, tuple[str, str]] = {}
    for tool in tools or []:
        if tool.get("type") == "namespace":
            for fn in tool["tools"]:
                names[f"{tool['name']}{NAMESPACE_SEPARATOR}{fn['name']}"] = (tool["name"], fn["name"])
    return names


def _call_item(call_id: str | None, name: str, arguments: str, namespaced: dict[str, tuple[str, str]]) -> dict:
    """A function_call item of the model's call of ``name`` (a namespace's function: its name and namespace)."""
    namespace, own = namespaced.get(name, (None, name))
    return function_call_item(new_id("fc"), call_id or new_id("call"), own, arguments, namespace=namespace)


def _flat_name(item: dict, where: str) -> str:
    """A function_call input item's function as the model was shown it (``<namespace>__<name>`` in a namespace)."""
    name = string_field(item, "name", where)
    if item.get("namespace") is None:
        return name
    return f"{string_field(item, 'namespace', where)}{NAMESPACE_SEPARATOR}{name}"


def _chat_tool_choice(choice: str | dict | None, tools: list[dict] | None) -> str | dict | None:
    """Responses' tool_choice ({"type": "function", "name": ...} for a named one) as chat's; a namespace's function
    is named by its flat name, or by its own name where no other namespace holds one of that name (as vLLM)."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        check_keys(choice, {"type", "name"}, "tool_choice")
        name = choice["name"]
        namespaced = _namespaced(tools)
        top_level = {tool.get("name") for tool in tools or [] if tool.get("type") == "function"}
        if name not in top_level and name not in namespaced:
            flat = sorted(f for f, (_, own) in namespaced.items() if own == name)
            if len(flat) > 1:
                raise ValidationError(f"tool_choice {quoted(name)} is ambiguous: namespaces {', '.join(flat)} each "
                                      "hold a function of that name (name it as '<namespace>__<name>')",
                                      param="tool_choice.name", value=name)
            name = flat[0] if flat else name
        return {"type": "function", "function": {"name": name}}
    raise ValidationError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": "
                          f"...}} (built-in tool choices are not supported), got {quoted(choice)}", param="tool_choice")
