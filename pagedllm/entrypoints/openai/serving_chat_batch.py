"""vLLM's ``POST /v1/chat/completions/batch``: a chat request whose ``messages`` is a list of conversations,
each run as one chat completion (the chat route's own checks and path), answered as one chat.completion whose
choice i is conversation i's reply and whose usage sums theirs. Not streamed; no tools, no ``n`` over 1, no
beam search (400s naming the field, as vLLM)."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse, Response
from starlette.types import Message

from pagedllm.entrypoints.openai.http_guard import UnicodeCheckedRoute
from pagedllm.entrypoints.openai.limits import check_count
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionTokensDetails,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from pagedllm.entrypoints.openai.serving_pooling import check_generates
from pagedllm.errors import ValidationError

router = APIRouter(route_class=UnicodeCheckedRoute)
"""The batch route (attached by deploy.attach_deploy)."""

UNSUPPORTED = {"stream": "Batch chat completions do not support streaming: set stream to false",
               "tools": "Batch chat completions do not support tools",
               "use_beam_search": "Batch chat completions do not support beam search: set use_beam_search to false"}
"""Fields refused when set (truthy), as vLLM refuses them, with the message naming them."""


class _Disconnect:
    """One watcher of the client's connection shared by every conversation's wait (each would otherwise read the
    same ASGI receive channel at once)."""

    def __init__(self, raw: Request) -> None:
        self.raw = raw
        self.gone = asyncio.Event()
        self.task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self.raw.receive())["type"] != "http.disconnect":
            pass
        self.gone.set()

    async def receive(self) -> Message:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def conversations_of(body: Any, max_prompts: int) -> tuple[list[Any], dict[str, Any]]:
    """(the conversations, the fields every one shares): 400s naming what is not a batch request."""
    if not isinstance(body, dict):
        raise ValidationError("the request body must be a JSON object", param="body")
    conversations = body.get("messages")
    if not isinstance(conversations, list) or not conversations or \
            not all(isinstance(c, list) and c for c in conversations):
        raise ValidationError("messages must be a non-empty list of conversations, each a non-empty list of "
                              "messages", param="messages")
    check_count(conversations, max_prompts, "messages", "--max-prompts")
    for field, message in UNSUPPORTED.items():
        if body.get(field):
            raise ValidationError(message, param=field, value=body[field])
    if body.get("n", 1) not in (1, None):
        raise ValidationError("Batch chat completions do not support n > 1: set n to 1", param="n", value=body["n"])
    return conversations, {k: v for k, v in body.items() if k != "messages"}


def one_request(shared: dict[str, Any], conversation: list[Any], index: int) -> ChatCompletionRequest:
    """Conversation ``index`` as a chat request (a field error names messages[index]...)."""
    try:
        return ChatCompletionRequest.model_validate({**shared, "messages": conversation})
    except pydantic.ValidationError as e:
        errors = e.errors(include_url=False, include_context=False)
        for error in errors:
            loc = tuple(error.get("loc", ()))
            if loc[:1] == ("messages",):
                error["loc"] = ("messages", index, *loc[1:])
        raise RequestValidationError(errors) from None


def _in_conversation(error: ValidationError, index: int) -> ValidationError:
    """A chat check's error about ``messages[j]...``, renamed ``messages[index][j]...`` (the batch's field)."""
    param = error.param or ""
    if not param.startswith("messages"):
        return error
    name = f"messages[{index}]" + param[len("messages"):]
    return ValidationError(error.message.replace(param, name, 1), param=name, value=error.value)


def merged(runs: list[ChatRun], replies: list[ChatCompletionResponse], details: bool) -> ChatCompletionResponse:
    """One chat.completion: choice i is conversation i's, usage the sum (cached and reasoning tokens too, where
    reported)."""
    choices = []
    for index, reply in enumerate(replies):
        choice = reply.choices[0]
        choice.index = index
        choices.append(choice)
    prompt = sum(r.usage.prompt_tokens for r in replies)
    completion = sum(r.usage.completion_tokens for r in replies)
    cached = sum(r.usage.cached_tokens for r in replies)
    reasoning = [r.usage.completion_tokens_details for r in replies if r.usage.completion_tokens_details]
    usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                      cached_tokens=cached,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if details else None,
                      completion_tokens_details=CompletionTokensDetails(
                          reasoning_tokens=sum(d.reasoning_tokens for d in reasoning)) if reasoning else None)
    return ChatCompletionResponse(id=random_id("chatcmpl"), model=runs[0].model, choices=choices, usage=usage)


@router.post("/v1/chat/completions/batch")
async def batch_chat_completions(raw: Request) -> Response:
    """Each conversation checked and queued as its own chat completion (in order: a refused one withdraws the
    ones already queued), then all awaited together; a client that leaves withdraws them all."""
    check_generates(raw.app.state.config.model, raw.url.path)
    chat: OpenAIServingChat = raw.app.state.chat
    try:
        body = await raw.json()
    except ValueError as e:
        raise ValidationError(f"request body is not valid JSON: {e}") from None
    conversations, shared = conversations_of(body, chat.limits.max_prompts)
    requests = [one_request(shared, c, i) for i, c in enumerate(conversations)]
    disconnect = _Disconnect(raw)
    watched = Request(raw.scope, receive=disconnect.receive)
    runs: list[ChatRun] = []
    replies: list[ChatCompletionResponse | None] = []
    try:
        for index, req in enumerate(requests):
            try:
                run = await chat.start(req, watched)
            except ValidationError as e:
                raise _in_conversation(e, index) from None
            if run is None:
                return Response(status_code=499)  # the client went away (finally withdraws the others)
            runs.append(run)
        results = await asyncio.gather(*(chat.response(run, watched) for run in runs), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:  # (a timeout, a failed request, a dead engine: the first, as the chat route's)
            raise failure
        replies = list(results)  # type: ignore[arg-type]
    finally:
        if len(replies) != len(requests):  # refused, failed or abandoned part-way: nothing is left running
            for run in runs:
                for stream in run.streams:
                    stream.abort()
        disconnect.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await disconnect.task
    if any(reply is None for reply in replies):
        return Response(status_code=499)
    return JSONResponse(merged(runs, replies, chat.prompt_tokens_details).model_dump())  # type: ignore[arg-type]
