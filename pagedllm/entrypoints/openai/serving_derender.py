"""vLLM's scale-out derender routes (--enable-scale-out or --tokens-only): POST /v1/chat/completions/derender and
/v1/completions/derender turn the token ids a /inference/v1/generate reply (output_mode "tokens") carries back into
the chat or completions reply the coupled route would have answered for them: the same detokenizer (the prompt's
tail as context, stop strings cut, an EOS or stop token's text left out unless include_stop_str_in_output), the
same reasoning and tool-call parsing (the chat route's own ``_message``, with the request's tools and template
variables), the same finish_reason rewrite. The original request comes along (``chat_request`` /
``completion_request``, as /render read it); it is checked as its route checks it and its prompt rendered again,
so the parsers see what the coupled route saw.

Refused with a 400 naming the field, not ignored: the streaming form (``stream: true`` with ``stream_state``),
a generate reply in another output_mode, and choices' ``logprobs`` (vLLM resolves them against the tokenizer:
not done here)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pydantic import Field, StrictBool
from pydantic import ValidationError as PydanticValidationError

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.entrypoints.openai.limits import check_count
from pagedllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    OpenAIModel,
    TokenIds,
)
from pagedllm.entrypoints.openai.translate import chat_request
from pagedllm.errors import ValidationError
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion


class DerenderChoice(OpenAIModel):
    """One choice of a generate reply: its token ids and how it ended (other keys of the reply are read by
    nothing)."""

    model_config = {"extra": "ignore"}
    index: int = 0
    token_ids: TokenIds = Field(max_length=1 << 20)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Any = None


class DerenderGenerateResponse(OpenAIModel):
    """A /inference/v1/generate reply as derender reads it (its other keys are read by nothing)."""

    model_config = {"extra": "ignore"}
    request_id: str = ""
    choices: list[DerenderChoice] = Field(min_length=1, max_length=1024)
    prompt_token_ids: TokenIds | None = None
    usage: dict[str, Any] | None = None
    output_mode: str = "tokens"


class DerenderChatRequest(OpenAIModel):
    """POST /v1/chat/completions/derender (vLLM's DerenderChatRequest, non-streaming)."""

    stream: StrictBool = False
    stream_state: dict | None = None
    model: str | None = None
    generate_response: DerenderGenerateResponse
    prompt_tokens: int | None = Field(default=None, ge=0)
    prompt_token_ids: TokenIds | None = None
    chat_request: dict[str, Any]


class DerenderCompletionRequest(OpenAIModel):
    """POST /v1/completions/derender (vLLM's DerenderCompletionRequest, non-streaming): one generate reply per
    prompt, as /v1/completions/render listed them."""

    stream: StrictBool = False
    stream_state: dict | None = None
    model: str | None = None
    generate_responses: list[DerenderGenerateResponse] = Field(min_length=1, max_length=1024)
    """(At most 1024: --max-prompts' default bound on a completion request's prompts.)"""
    prompt_tokens: list[int] | None = Field(default=None, max_length=1024)
    prompt_token_ids: list[TokenIds | None] | None = Field(default=None, max_length=1024)
    completion_request: dict[str, Any] | None = None
    """The original request (its stop strings, skip_special_tokens, n, return_token_ids); omitted: their
    defaults, the model's name from ``model``."""


def _check_common(req: DerenderChatRequest | DerenderCompletionRequest,
                  responses: list[DerenderGenerateResponse], field: str) -> None:
    if req.stream or req.stream_state is not None:
        raise ValidationError("streaming derender (stream: true, stream_state) is not supported by this server: "
                              "derender the whole generate reply", param="stream")
    for response in responses:
        if response.output_mode != "tokens":
            raise ValidationError(f"only output_mode 'tokens' replies can be derendered, got "
                                  f"{response.output_mode!r}", param=f"{field}.output_mode")
        for j, choice in enumerate(response.choices):
            if choice.logprobs is not None:
                raise ValidationError("logprobs cannot be derendered by this server (send the reply without them)",
                                      param=f"{field}.choices[{j}].logprobs")


def _check_sizes(responses: list[DerenderGenerateResponse], n: int, max_model_len: int, field: str) -> None:
    """Every size the client sent bounded by what the original request could have generated, before any work: at
    most ``n`` choices a reply, each at most max_model_len tokens (400 naming the field)."""
    for i, response in enumerate(responses):
        where = field if len(responses) == 1 else f"{field}[{i}]"
        if len(response.choices) > n:
            raise ValidationError(f"{where}.choices has {len(response.choices)} choices; the request asks for n={n}",
                                  param=f"{where}.choices", value=len(response.choices))
        for j, choice in enumerate(response.choices):
            if len(choice.token_ids) > max_model_len:
                raise ValidationError(f"{where}.choices[{j}].token_ids has {len(choice.token_ids)} tokens, more than "
                                      f"max_model_len ({max_model_len})", param=f"{where}.choices[{j}].token_ids",
                                      value=len(choice.token_ids))
        if response.prompt_token_ids is not None and len(response.prompt_token_ids) > max_model_len:
            raise ValidationError(f"{where}.prompt_token_ids is longer than max_model_len ({max_model_len})",
                                  param=f"{where}.prompt_token_ids", value=len(response.prompt_token_ids))


def _check_prompt_ids(given: list[list[int] | None], max_model_len: int, field: str) -> None:
    for i, ids in enumerate(given):
        if ids is not None and len(ids) > max_model_len:
            where = field if len(given) == 1 else f"{field}[{i}]"
            raise ValidationError(f"{where} is longer than max_model_len ({max_model_len})", param=where,
                                  value=len(ids))


def _text(tokenizer: Any, eos_ids: tuple[int, ...], prompt_ids: list[int], params: SamplingParams,
          choice: DerenderChoice) -> str:
    """The text the coupled route gives for the choice's tokens: the same incremental detokenizer, fed them."""
    ids = list(choice.token_ids)
    stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    if isinstance(choice.stop_reason, str) and choice.stop_reason not in stops:
        # (the stop string generate reports: cut there even where the request's own list is not sent)
        params = dataclasses.replace(params, stop=[*stops, choice.stop_reason])
    stop_ids = set(eos_ids) | set(params.stop_token_ids or ())
    by_token = choice.finish_reason == "stop" and bool(ids) and ids[-1] in stop_ids and \
        not isinstance(choice.stop_reason, str)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    detokenizer.update(ids, by_token)
    return detokenizer.output_text


def _within(field: str, error: ValidationError) -> ValidationError:
    """``error`` of the original request, its param named inside ``field``."""
    param = field if error.param is None else f"{field}.{error.param}"
    return ValidationError(f"{field}: {error.message}", param=param, value=error.value)


def _prompt_tokens(given: int | None, response: DerenderGenerateResponse) -> int:
    if given is not None:
        return given
    usage = response.usage or {}
    value = usage.get("prompt_tokens")
    return value if isinstance(value, int) and value >= 0 else 0


async def derender_chat(chat: OpenAIServingChat, req: DerenderChatRequest) -> dict[str, Any]:
    """The chat completion reply of a generate reply's tokens (vLLM's ChatCompletionResponse)."""
    response = req.generate_response
    _check_common(req, [response], "generate_response")
    try:
        chat_req = chat_request(dict(req.chat_request), {})
        prep = await chat.prepare(chat_req)  # (checked as the route checks it; rendered: the parsers read the prompt)
    except ValidationError as e:
        raise _within("chat_request", e) from None
    _check_sizes([response], chat_req.n or 1, chat.max_model_len, "generate_response")
    _check_prompt_ids([req.prompt_token_ids], chat.max_model_len, "prompt_token_ids")
    prompt_ids = list(req.prompt_token_ids or response.prompt_token_ids or prep.prompt_ids)
    eos = chat.engine.processor.eos_token_ids
    texts = await chat.engine.in_tokenizer_thread(  # (never on the event loop: up to n x max_model_len tokens)
        lambda: [_text(chat.tokenizer, eos, prompt_ids, prep.params, c) for c in response.choices])
    hide = not chat_req.include_reasoning and chat.reasoning_parser is not None
    choices = []
    for choice, text in zip(response.choices, texts):
        message, finish = chat.message_of(text, choice.finish_reason, prep.tools, prep.reasoning)
        shown_ids = None if hide or not chat_req.return_token_ids else list(choice.token_ids)
        if hide:
            message.reasoning_content = None
        choices.append(ChatChoice(index=choice.index, message=message, finish_reason=finish,
                                  stop_reason=choice.stop_reason, token_ids=shown_ids))
    completion = sum(len(c.token_ids) for c in response.choices)
    usage = chat.usage(_prompt_tokens(req.prompt_tokens, response), completion)
    return ChatCompletionResponse(id=f"chatcmpl-{response.request_id or 'derender'}", model=prep.model,
                                  choices=choices, usage=usage,
                                  prompt_token_ids=prompt_ids if chat_req.return_token_ids else None).model_dump()


async def derender_completion(completion: OpenAIServingCompletion, req: DerenderCompletionRequest) -> dict[str, Any]:
    """The completions reply of the generate replies' tokens, one per prompt (vLLM's CompletionResponse)."""
    responses = req.generate_responses
    _check_common(req, responses, "generate_responses")
    for name, given in (("prompt_tokens", req.prompt_tokens), ("prompt_token_ids", req.prompt_token_ids)):
        if given is not None and len(given) != len(responses):
            raise ValidationError(f"{name} has {len(given)} entries for {len(responses)} generate_responses",
                                  param=name)
    try:
        comp_req = CompletionRequest(**(req.completion_request or {"model": req.model, "prompt": "-"}))
        if comp_req.echo:
            raise ValidationError("echo cannot be derendered (the reply would start with the prompt)", param="echo")
        model, _ = completion.check_model(comp_req.model)
        completion.check_limits(comp_req)
        params = completion.sampling_params(comp_req, comp_req.max_tokens, None, False)
    except PydanticValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ValidationError(f"completion_request.{where}: {first.get('msg')}",
                              param=f"completion_request.{where}") from None
    except ValidationError as e:
        raise _within("completion_request", e) from None
    n = comp_req.n or 1
    check_count(responses, completion.limits.max_prompts, "generate_responses", "--max-prompts")
    _check_sizes(responses, n, completion.max_model_len, "generate_responses")
    _check_prompt_ids(req.prompt_token_ids or [], completion.max_model_len, "prompt_token_ids")
    prompts = [list((None if req.prompt_token_ids is None else req.prompt_token_ids[i]) or
                    response.prompt_token_ids or []) for i, response in enumerate(responses)]
    eos = completion.engine.processor.eos_token_ids
    texts = await completion.engine.in_tokenizer_thread(  # (never on the event loop)
        lambda: [[_text(completion.tokenizer, eos, p, params, c) for c in r.choices]
                 for p, r in zip(prompts, responses)])
    choices, prompt_total, generated = [], 0, 0
    for i, (response, prompt_ids) in enumerate(zip(responses, prompts)):
        prompt_total += _prompt_tokens(None if req.prompt_tokens is None else req.prompt_tokens[i], response)
        for choice, text in zip(response.choices, texts[i]):
            generated += len(choice.token_ids)
            ids = list(choice.token_ids) if comp_req.return_token_ids else None
            choices.append(CompletionChoice(index=i * n + choice.index, text=text, finish_reason=choice.finish_reason,
                                            stop_reason=choice.stop_reason, token_ids=ids,
                                            prompt_token_ids=prompt_ids if comp_req.return_token_ids else None))
    first = responses[0].request_id or "derender"
    return CompletionResponse(id=f"cmpl-{first}", model=model, choices=choices,
                              usage=completion.usage(prompt_total, generated)).model_dump()
