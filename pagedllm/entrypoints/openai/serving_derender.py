"""vLLM's scale-out derender routes (--enable-scale-out or --tokens-only): POST /v1/chat/completions/derender and
/v1/completions/derender turn the token ids a /inference/v1/generate reply (output_mode "tokens") carries back into
the chat or completions reply the coupled route would have answered for them: the same detokenizer (the prompt's
tail as context, stop strings cut, an EOS or stop token's text left out unless include_stop_str_in_output), the
same reasoning and tool-call parsing (the chat route's own ``_message``, with the request's tools and template
variables), the same finish_reason rewrite. The original request comes along (``chat_request`` /
``completion_request``, as /render read it); it is checked as its route checks it and its prompt rendered again,
so the parsers see what the coupled route saw.

The streamed form (``stream: true``: one generate chunk a call, with the ``stream_state`` the last call returned)
is derender_stream.py's. A choice's ``logprobs`` (generate's, by token id) come back in the coupled route's shape,
each token and candidate decoded as it decodes them. Refused with a 400 naming the field, not ignored: a generate
reply in another output_mode, ``stream_state`` without ``stream``, logprobs that are not one entry per token."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import Field, StrictBool, StrictInt
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
    PromptLogprob,
    TokenIds,
)
from pagedllm.entrypoints.openai.serving import EVERY_LISTED, shown_logprobs
from pagedllm.entrypoints.openai.translate import chat_request
from pagedllm.errors import ValidationError
from pagedllm.outputs import CompletionOutput, Logprob
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
    from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion


class LogprobIn(OpenAIModel):
    """One candidate of a generate reply's logprobs (its GenerateLogProb), read back."""

    model_config = {"extra": "ignore"}
    token_id: StrictInt
    logprob: float
    rank: int | None = Field(default=None, ge=1)


class LogprobsContentIn(LogprobIn):
    """One position: its sampled token, then the candidates (the sampled one first, then by rank)."""

    top_logprobs: list[LogprobIn] = Field(default_factory=list, max_length=1 << 16)


class LogprobsIn(OpenAIModel):
    model_config = {"extra": "ignore"}
    content: list[LogprobsContentIn] | None = Field(default=None, max_length=1 << 20)


class PromptLogprobIn(OpenAIModel):
    model_config = {"extra": "ignore"}
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class DerenderChoice(OpenAIModel):
    """One choice of a generate reply (streamed: of one chunk): its token ids, how it ended and their logprobs
    (other keys of the reply are read by nothing)."""

    model_config = {"extra": "ignore"}
    index: int = Field(default=0, ge=0, le=1 << 20)
    token_ids: TokenIds = Field(default_factory=list, max_length=1 << 20)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: LogprobsIn | None = None


class DerenderGenerateResponse(OpenAIModel):
    """A /inference/v1/generate reply as derender reads it (its other keys are read by nothing)."""

    model_config = {"extra": "ignore"}
    request_id: str = ""
    choices: list[DerenderChoice] = Field(min_length=1, max_length=1024)
    prompt_token_ids: TokenIds | None = None
    usage: dict[str, Any] | None = None
    output_mode: str = "tokens"
    prompt_logprobs: list[dict[str, PromptLogprobIn] | None] | None = Field(default=None, max_length=1 << 20)
    """Passed through, each null decoded_token filled as the engine decodes it."""
    kv_transfer_params: dict[str, Any] | None = None
    """Passed through."""


class DerenderChatRequest(OpenAIModel):
    """POST /v1/chat/completions/derender (vLLM's DerenderChatRequest, non-streaming)."""

    stream: StrictBool = False
    stream_state: dict | None = None
    model: str | None = None
    generate_response: DerenderGenerateResponse
    prompt_tokens: int | None = Field(default=None, ge=0)
    prompt_token_ids: TokenIds | None = None
    chat_request: dict[str, Any] | None = None
    """The original request; omitted (only on a server without a reasoning or tool parser): plain detokenizing."""


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


@dataclass
class ChatContext:
    """What a derender call needs of the original chat request: the model's name, the sampling params its text was
    made under, how its replies are parsed and shown (a ChatRun with no streams), its rendered prompt's ids."""

    model: str
    params: SamplingParams
    run: ChatRun
    prompt_ids: list[int]
    return_ids: bool
    """return_token_ids."""


@dataclass
class CompletionContext:
    """The same of a completions request: its model's name, params, n, logprobs shown and flags."""

    model: str
    params: SamplingParams
    n: int
    top_n: int
    as_ids: bool
    return_ids: bool


def _needs_parsing(chat: OpenAIServingChat) -> bool:
    return chat.reasoning_parser is not None or chat.tool_parser is not None


async def chat_context(chat: OpenAIServingChat, fields: dict[str, Any] | None, model: str | None) -> ChatContext:
    """The original chat request checked as its route checks it and its prompt rendered again (the parsers read
    it); None: plain detokenizing under default params, refused where a parser would have read the reply."""
    from pagedllm.entrypoints.openai.serving_chat import ChatRun

    if fields is None:
        return _plain_context(chat, model)
    try:
        req = chat_request(dict(fields), {})
        prep = await chat.prepare(req)  # (rendered: the parsers read the prompt)
    except ValidationError as e:
        raise _within("chat_request", e) from None
    run = ChatRun("", prep.model, None, prep.tools, len(prep.prompt_ids),
                  EVERY_LISTED if prep.logprobs is None else shown_logprobs(req, prep.logprobs),
                  as_ids=chat.as_token_ids(req), reasoning=prep.reasoning,
                  hide_reasoning=not req.include_reasoning and chat.reasoning_parser is not None)
    return ChatContext(prep.model, prep.params, run, list(prep.prompt_ids), bool(req.return_token_ids))


def _plain_context(chat: OpenAIServingChat, model: str | None) -> ChatContext:
    """No original request: plain detokenizing under default params, refused where a parser would read the reply."""
    from pagedllm.entrypoints.openai.serving_chat import ChatRun, _ToolMode

    if _needs_parsing(chat):
        raise ValidationError("chat_request is required on a server with a tool or reasoning parser: plain "
                              "detokenizing would leave the parsers' markup in the content", param="chat_request")
    name, _ = chat.check_model(model)
    return ChatContext(name, SamplingParams(), ChatRun("", name, None, _ToolMode(), 0, EVERY_LISTED), [], False)


def completion_context(completion: OpenAIServingCompletion, fields: dict[str, Any] | None,
                       model: str | None) -> CompletionContext:
    """The original completions request checked as its route checks it (omitted: its defaults)."""
    try:
        req = CompletionRequest(**(fields or {"model": model, "prompt": "-"}))
        if req.echo:
            raise ValidationError("echo cannot be derendered (the reply would start with the prompt)", param="echo")
        name, _ = completion.check_model(req.model)
        completion.check_limits(req)
        params = completion.sampling_params(req, req.max_tokens, None, False)
    except PydanticValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ValidationError(f"completion_request.{where}: {first.get('msg')}",
                              param=f"completion_request.{where}") from None
    except ValidationError as e:
        raise _within("completion_request", e) from None
    top_n = EVERY_LISTED if req.logprobs is None else shown_logprobs(req, req.logprobs) or 0
    return CompletionContext(name, params, req.n or 1, top_n, completion.as_token_ids(req),
                             bool(req.return_token_ids))


def check_output_mode(mode: str, field: str) -> None:
    if mode != "tokens":
        raise ValidationError(f"only output_mode 'tokens' replies can be derendered, got {mode!r}",
                              param=f"{field}.output_mode")


def check_choice(choice: DerenderChoice, where: str, max_tokens: int, vocab: int, max_logprobs: int) -> None:
    """A choice's sizes and ids bounded before any work (400 naming the field): at most ``max_tokens`` tokens, each
    in the vocabulary; logprobs, if any, one entry per token, that token first, at most 1 + max_logprobs
    candidates."""
    ids = choice.token_ids
    if len(ids) > max_tokens:
        raise ValidationError(f"{where}.token_ids has {len(ids)} tokens, more than max_model_len leaves room for "
                              f"({max_tokens})", param=f"{where}.token_ids", value=len(ids))
    check_vocab(ids, vocab, f"{where}.token_ids")
    content = None if choice.logprobs is None else choice.logprobs.content
    if content is not None:
        _check_logprobs(ids, content, where, vocab, max_logprobs)


def _check_logprobs(ids: list[int], content: list[LogprobsContentIn], where: str, vocab: int,
                    max_logprobs: int) -> None:
    if len(content) > len(ids):
        raise ValidationError(f"{where}.logprobs.content has {len(content)} entries for {len(ids)} token_ids (one "
                              f"per token at most, from the first)", param=f"{where}.logprobs.content",
                              value=len(content))
    for i, (token_id, entry) in enumerate(zip(ids, content)):
        at = f"{where}.logprobs.content[{i}]"
        if entry.token_id != token_id:
            raise ValidationError(f"{at}.token_id is {entry.token_id}, not the token at that position ({token_id})",
                                  param=f"{at}.token_id", value=entry.token_id)
        if len(entry.top_logprobs) > 1 + max_logprobs:
            raise ValidationError(f"{at}.top_logprobs has {len(entry.top_logprobs)} entries, more than the sampled "
                                  f"token and max_logprobs ({max_logprobs})", param=f"{at}.top_logprobs",
                                  value=len(entry.top_logprobs))
        check_vocab([t.token_id for t in entry.top_logprobs], vocab, f"{at}.top_logprobs")


def check_vocab(ids: list[int], vocab: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValidationError(f"{param} contains token id {bad}, outside the vocabulary [0, {vocab})", param=param,
                              value=bad)


def stop_params(params: SamplingParams, choice: DerenderChoice, eos_ids: tuple[int, ...]
                ) -> tuple[SamplingParams, bool]:
    """(the params the choice's text is cut under: the stop string generate reports added, even where the request's
    own list is not sent; whether its last token is an EOS or stop token whose text is left out)."""
    ids = choice.token_ids
    stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    if isinstance(choice.stop_reason, str) and choice.stop_reason not in stops:
        params = dataclasses.replace(params, stop=[*stops, choice.stop_reason])
    stop_ids = set(eos_ids) | set(params.stop_token_ids or ())
    by_token = choice.finish_reason == "stop" and bool(ids) and ids[-1] in stop_ids and \
        not isinstance(choice.stop_reason, str)
    return params, by_token


def logprob_entries(tokenizer: Any, logprobs: LogprobsIn | None) -> list[dict[int, Logprob]] | None:
    """Generate's logprobs (by token id) as the engine's: per position, token id -> Logprob with the token decoded
    as the engine decodes it; the candidates listed are the top_logprobs shown (a candidate without a rank is
    ranked by its logprob among them)."""
    if logprobs is None or logprobs.content is None:
        return None
    decoded: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in decoded:
            decoded[token_id] = tokenizer.decode([token_id])
        return decoded[token_id]

    entries = []
    for e in logprobs.content:
        by_value = sorted({t.token_id: t.logprob for t in e.top_logprobs}.items(), key=lambda item: -item[1])
        order = {token_id: rank for rank, (token_id, _) in enumerate(by_value, 1)}
        entry = {t.token_id: Logprob(t.logprob, t.rank or order[t.token_id], text(t.token_id)) for t in e.top_logprobs}
        # (the sampled token, when the candidates leave it out, is not one of the shown top_logprobs: no rank)
        entry.setdefault(e.token_id, Logprob(e.logprob, None, text(e.token_id)))
        entries.append(entry)
    return entries


def prompt_logprobs_of(tokenizer: Any, vocab: int, given: list[dict[str, PromptLogprobIn] | None] | None
                       ) -> list[dict[int, PromptLogprob] | None] | None:
    """A generate reply's prompt_logprobs passed through, each null decoded_token decoded (an id outside the
    vocabulary: ""); keys that are not token ids are a 400 naming the field."""
    if given is None:
        return None
    out: list[dict[int, PromptLogprob] | None] = []
    for i, entry in enumerate(given):
        if entry is None:
            out.append(None)
            continue
        if any(not key.lstrip("-").isdigit() for key in entry):
            raise ValidationError(f"generate_response.prompt_logprobs[{i}] has a key that is not a token id",
                                  param=f"generate_response.prompt_logprobs[{i}]")
        out.append({int(key): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token if
                                            lp.decoded_token is not None else
                                            tokenizer.decode([int(key)]) if 0 <= int(key) < vocab else "")
                    for key, lp in entry.items()})
    return out


def _text(tokenizer: Any, eos_ids: tuple[int, ...], prompt_ids: list[int], params: SamplingParams,
          choice: DerenderChoice) -> str:
    """The text the coupled route gives for the choice's tokens: the same incremental detokenizer, fed them."""
    params, by_token = stop_params(params, choice, eos_ids)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    detokenizer.update(list(choice.token_ids), by_token)
    return detokenizer.output_text


def _within(field: str, error: ValidationError) -> ValidationError:
    """``error`` of the original request, its param named inside ``field``."""
    param = field if error.param is None else f"{field}.{error.param}"
    return ValidationError(f"{field}: {error.message}", param=param, value=error.value)


def prompt_tokens_of(given: int | None, usage: dict[str, Any] | None) -> int:
    """The prompt's token count for the usage: the one sent, else the generate reply's own."""
    if given is not None:
        return given
    value = (usage or {}).get("prompt_tokens")
    return value if isinstance(value, int) and value >= 0 else 0


def _check_whole(req: DerenderChatRequest | DerenderCompletionRequest, responses: list[DerenderGenerateResponse],
                 n: int, serving: Any, field: str) -> None:
    """The non-streamed form's checks, before any work: no stream_state, every reply in output_mode "tokens" with
    at most ``n`` choices, each bounded (check_choice), the prompt's ids at most max_model_len."""
    if req.stream_state is not None:
        raise ValidationError("stream_state goes with stream: true (one generate chunk a call)", param="stream_state")
    max_len, limits = serving.max_model_len, serving.limits
    vocab = serving.engine.processor.vocab_size
    for i, response in enumerate(responses):
        where = field if len(responses) == 1 else f"{field}[{i}]"
        check_output_mode(response.output_mode, where)
        if len(response.choices) > n:
            raise ValidationError(f"{where}.choices has {len(response.choices)} choices; the request asks for n={n}",
                                  param=f"{where}.choices", value=len(response.choices))
        for j, choice in enumerate(response.choices):
            if not choice.token_ids:  # (as vLLM: a whole reply has tokens; a streamed chunk may have none)
                raise ValidationError(f"{where}.choices[{j}].token_ids is empty",
                                      param=f"{where}.choices[{j}].token_ids")
            check_choice(choice, f"{where}.choices[{j}]", max_len, vocab, limits.max_logprobs)
        if response.prompt_token_ids is not None and len(response.prompt_token_ids) > max_len:
            raise ValidationError(f"{where}.prompt_token_ids is longer than max_model_len ({max_len})",
                                  param=f"{where}.prompt_token_ids", value=len(response.prompt_token_ids))
        _check_prompt_logprobs(response.prompt_logprobs or [], f"{where}.prompt_logprobs", max_len,
                               limits.max_logprobs)


def _check_prompt_logprobs(entries: list[dict | None], where: str, max_len: int, max_logprobs: int) -> None:
    """Passed-through prompt_logprobs bounded as the engine would make them (each entry decoded): one per prompt
    position, each the prompt token and at most max_logprobs others."""
    if len(entries) > max_len:
        raise ValidationError(f"{where} has {len(entries)} entries, more than max_model_len ({max_len})",
                              param=where, value=len(entries))
    for i, entry in enumerate(entries):
        if entry is not None and len(entry) > 1 + max_logprobs:
            raise ValidationError(f"{where}[{i}] has {len(entry)} entries, more than the prompt token and "
                                  f"max_logprobs ({max_logprobs})", param=f"{where}[{i}]", value=len(entry))


def check_prompt_ids(given: list[list[int] | None], max_model_len: int, field: str) -> None:
    for i, ids in enumerate(given):
        if ids is not None and len(ids) > max_model_len:
            where = field if len(given) == 1 else f"{field}[{i}]"
            raise ValidationError(f"{where} is longer than max_model_len ({max_model_len})", param=where,
                                  value=len(ids))


def _output(choice: DerenderChoice, text: str, tokenizer: Any) -> CompletionOutput:
    """A choice as the engine's output: its text, tokens and logprobs decoded."""
    return CompletionOutput(choice.index, text, list(choice.token_ids), None,
                            logprob_entries(tokenizer, choice.logprobs), choice.finish_reason, choice.stop_reason)


async def derender_chat(chat: OpenAIServingChat, req: DerenderChatRequest) -> dict[str, Any]:
    """The chat completion reply of a generate reply's tokens (vLLM's ChatCompletionResponse)."""
    response = req.generate_response
    context = await chat_context(chat, req.chat_request, req.model)
    _check_whole(req, [response], context.params.n, chat, "generate_response")
    check_prompt_ids([req.prompt_token_ids], chat.max_model_len, "prompt_token_ids")
    prompt_ids = list(req.prompt_token_ids or response.prompt_token_ids or context.prompt_ids)
    eos, run = chat.engine.processor.eos_token_ids, context.run
    outputs = await chat.engine.in_tokenizer_thread(  # (never on the event loop: up to n x max_model_len tokens)
        lambda: [_output(c, _text(chat.tokenizer, eos, prompt_ids, context.params, c), chat.tokenizer)
                 for c in response.choices])
    choices = []
    for c in outputs:
        message, finish = chat.message_of(c.text, c.finish_reason, run.tools, run.reasoning)
        choice = ChatChoice(index=c.index, message=message, finish_reason=finish, stop_reason=c.stop_reason,
                            logprobs=chat.logprobs_of(c, run.logprobs, run.as_ids),
                            token_ids=list(c.token_ids) if context.return_ids else None)
        chat.shown(run, choice)  # (include_reasoning false: no reasoning, nor what would show it)
        choices.append(choice)
    completion = sum(len(c.token_ids) for c in response.choices)
    usage = chat.usage(prompt_tokens_of(req.prompt_tokens, response.usage), completion)
    shown_ids = prompt_ids if context.return_ids and not run.hide_reasoning else None
    prompt_logprobs = await chat.engine.in_tokenizer_thread(
        prompt_logprobs_of, chat.tokenizer, chat.engine.processor.vocab_size, response.prompt_logprobs)
    return ChatCompletionResponse(id=f"chatcmpl-{response.request_id or 'derender'}", model=context.model,
                                  choices=choices, usage=usage, prompt_token_ids=shown_ids,
                                  prompt_logprobs=prompt_logprobs,
                                  kv_transfer_params=response.kv_transfer_params).model_dump()


async def derender_completion(completion: OpenAIServingCompletion, req: DerenderCompletionRequest) -> dict[str, Any]:
    """The completions reply of the generate replies' tokens, one per prompt (vLLM's CompletionResponse)."""
    responses = req.generate_responses
    for name, given in (("prompt_tokens", req.prompt_tokens), ("prompt_token_ids", req.prompt_token_ids)):
        if given is not None and len(given) != len(responses):
            raise ValidationError(f"{name} has {len(given)} entries for {len(responses)} generate_responses",
                                  param=name)
    context = completion_context(completion, req.completion_request, req.model)
    check_count(responses, completion.limits.max_prompts, "generate_responses", "--max-prompts")
    _check_whole(req, responses, context.n, completion, "generate_responses")
    check_prompt_ids(req.prompt_token_ids or [], completion.max_model_len, "prompt_token_ids")
    prompts = [list((None if req.prompt_token_ids is None else req.prompt_token_ids[i]) or
                    response.prompt_token_ids or []) for i, response in enumerate(responses)]
    eos, tokenizer = completion.engine.processor.eos_token_ids, completion.tokenizer
    outputs = await completion.engine.in_tokenizer_thread(  # (never on the event loop)
        lambda: [[_output(c, _text(tokenizer, eos, p, context.params, c), tokenizer) for c in r.choices]
                 for p, r in zip(prompts, responses)])
    choices = [_completion_choice(completion, context, i * context.n, c, prompt_ids)
               for i, prompt_ids in enumerate(prompts) for c in outputs[i]]
    prompt_total = sum(prompt_tokens_of(None if req.prompt_tokens is None else req.prompt_tokens[i], r.usage)
                       for i, r in enumerate(responses))
    generated = sum(len(c.token_ids) for r in responses for c in r.choices)
    first = responses[0].request_id or "derender"
    kv_params = {json.dumps(r.kv_transfer_params, sort_keys=True) for r in responses}
    return CompletionResponse(id=f"cmpl-{first}", model=context.model, choices=choices,
                              usage=completion.usage(prompt_total, generated),  # (the replies' own, if they agree)
                              kv_transfer_params=responses[0].kv_transfer_params if len(kv_params) == 1 else None
                              ).model_dump()


def _completion_choice(completion: OpenAIServingCompletion, context: CompletionContext, first_index: int,
                       c: CompletionOutput, prompt_ids: list[int]) -> CompletionChoice:
    """One derendered choice of a prompt whose choices are numbered from ``first_index``."""
    lp = None if c.logprobs is None else completion.logprobs_of(c, 0, context.top_n, None, context.as_ids)
    return CompletionChoice(index=first_index + c.index, text=c.text, logprobs=lp, finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason, token_ids=list(c.token_ids) if context.return_ids else None,
                            prompt_token_ids=prompt_ids if context.return_ids else None)
