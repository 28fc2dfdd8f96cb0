"""The streamed form of vLLM's derender routes: POST /v1/chat/completions/derender and /v1/completions/derender
with ``stream: true`` take one chunk of a streamed /inference/v1/generate reply (output_mode "tokens") a call and
answer the chunk the coupled route would have streamed for its tokens (``chunk``), with a ``stream_state`` the
client sends back with the next chunk (null on the first). Nothing is kept here between calls, so any API server
can take the next one.

The state is what the chat route's stream keeps per choice: where the detokenizer stands (the reply's text so far
and its few-token decode window) and what of the text was sent; so a call costs its chunk's tokens, not the
reply's, and a reasoning or tool parser re-reads the text so far as the coupled stream does each step (its deltas
are chat_stream.py's, the coupled stream's own). The state comes back from the client: it is checked as any input
(sizes bounded, offsets inside what they index, ids in the vocabulary) and a state that does not decode is a 400.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictInt, Tag, model_validator

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.entrypoints.openai.chat_stream import ChoiceDeltas
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionStreamResponse,
    CompletionChoice,
    CompletionResponse,
    OpenAIModel,
    TokenIds,
    UsageInfo,
)
from pagedllm.entrypoints.openai.serving_derender import (
    DerenderChatRequest,
    DerenderChoice,
    DerenderCompletionRequest,
    chat_context,
    check_choice,
    check_output_mode,
    check_prompt_ids,
    check_vocab,
    completion_context,
    logprob_entries,
    prompt_tokens_of,
    stop_params,
)
from pagedllm.errors import ValidationError
from pagedllm.outputs import CompletionOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

MAX_WINDOW = 1024
"""Token ids a carried decode window may hold (it holds a few: those since the last whole character)."""
MAX_TEXT = 1 << 22
"""Characters of carried text (a reply of max_model_len tokens is far shorter)."""


class DerenderStreamState(OpenAIModel):
    """What a client carries from one call to the next (our own shape; send back what the last call answered)."""

    text: str = Field(default="", max_length=MAX_TEXT)
    """The reply's text so far, as the detokenizer holds it (a possible stop string's start included)."""
    sent: int = Field(default=0, ge=0)
    """How much of ``text`` was sent (the rest may begin a stop string)."""
    window: list[StrictInt] = Field(default_factory=list, max_length=MAX_WINDOW)
    read_offset: int = Field(default=0, ge=0)
    num_tokens: int = Field(default=0, ge=0)
    stop_checked: int = Field(default=0, ge=0)
    text_offset: int = Field(default=0, ge=0)
    """Completions' logprobs: the next token's text_offset."""
    role_sent: bool = False
    finished: bool = False

    @model_validator(mode="after")
    def _offsets_inside(self) -> DerenderStreamState:
        if self.sent > len(self.text) or self.stop_checked > len(self.text) or self.read_offset > len(self.window):
            raise ValueError("offsets past the text or window they index")
        return self


class GenerateChunk(OpenAIModel):
    """One chunk of a streamed generate reply as derender reads it (its other keys are read by nothing)."""

    model_config = {"extra": "ignore"}
    request_id: str = ""
    choices: list[DerenderChoice] = Field(default_factory=list, max_length=1024)
    prompt_token_ids: TokenIds | None = None
    usage: dict[str, Any] | None = None
    output_mode: str = "tokens"


class _StreamedDerender(OpenAIModel):
    """What both streamed derender requests carry: one generate chunk, the last call's state, the prompt."""

    stream: Literal[True]
    model: str | None = None
    generate_chunk: GenerateChunk
    stream_state: DerenderStreamState | None = None
    prompt_tokens: int | None = Field(default=None, ge=0)
    prompt_token_ids: TokenIds | None = None
    """Needed on a chat server with a reasoning or tool parser (whether the prompt left the reasoning open)."""


class DerenderChatStreamRequest(_StreamedDerender):
    """POST /v1/chat/completions/derender with stream: true (vLLM's DerenderChatStreamRequest)."""

    chat_request: dict[str, Any] | None = None


class DerenderCompletionStreamRequest(_StreamedDerender):
    """POST /v1/completions/derender with stream: true (vLLM's DerenderCompletionStreamRequest)."""

    completion_request: dict[str, Any] | None = None


WHOLE, STREAMED = "<derender>", "<derender stream>"
"""The two forms' tags: pydantic puts the tag in an error's location, which the server's error handler leaves out
(api_server._field_name: the client's field is named, not the form)."""


def _form(body: Any) -> str:
    """Which form a derender body is: the streamed one for stream: true (the discriminator), else the whole."""
    stream = body.get("stream") if isinstance(body, dict) else getattr(body, "stream", False)
    return STREAMED if stream is True else WHOLE


ChatDerenderBody = Annotated[Annotated[DerenderChatRequest, Tag(WHOLE)] |
                             Annotated[DerenderChatStreamRequest, Tag(STREAMED)], Discriminator(_form)]
CompletionDerenderBody = Annotated[Annotated[DerenderCompletionRequest, Tag(WHOLE)] |
                                   Annotated[DerenderCompletionStreamRequest, Tag(STREAMED)], Discriminator(_form)]


def _check_chunk(serving: Any, req: DerenderChatStreamRequest | DerenderCompletionStreamRequest) -> None:
    """Every size the client sent bounded before any work (400 naming the field): one choice a chunk (the state is
    one choice's), prompt, earlier and new tokens within max_model_len, ids in the vocabulary, a finished reply
    not carried on."""
    chunk, state = req.generate_chunk, req.stream_state
    check_output_mode(chunk.output_mode, "generate_chunk")
    if len(chunk.choices) > 1:
        raise ValidationError(f"generate_chunk.choices has {len(chunk.choices)} choices: a streamed derender takes "
                              "one choice a call (the stream_state is that choice's)", param="generate_chunk.choices")
    max_len, vocab = serving.max_model_len, serving.engine.processor.vocab_size
    check_prompt_ids([req.prompt_token_ids], max_len, "prompt_token_ids")
    prompt = len(req.prompt_token_ids or chunk.prompt_token_ids or [])
    earlier = 0 if state is None else state.num_tokens
    if state is not None:
        _check_state(state, bool(chunk.choices), vocab)
    for choice in chunk.choices:
        check_choice(choice, "generate_chunk.choices[0]", max(max_len - prompt - earlier, 0), vocab,
                     serving.limits.max_logprobs)


def _check_state(state: DerenderStreamState, more: bool, vocab: int) -> None:
    check_vocab(state.window, vocab, "stream_state.window")
    if state.finished and more:
        raise ValidationError("stream_state is of a finished reply: no chunk follows its last", param="stream_state")


def _detokenize(tokenizer: Any, eos: tuple[int, ...], prompt_ids: list[int], params: SamplingParams,
                state: DerenderStreamState | None, choice: DerenderChoice) -> tuple[str, str, DerenderStreamState]:
    """(the text sent before this chunk, this chunk's new text, the state after it): the chat route's detokenizer
    resumed from the state, fed the chunk (a stop string's possible start held back until the reply ends)."""
    params, by_token = stop_params(params, choice, eos)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids if state is None else [], params)
    if state is not None:
        detokenizer.resume(state.window, state.read_offset, state.num_tokens, state.text, state.stop_checked)
    state = state or DerenderStreamState()
    try:
        detokenizer.update(list(choice.token_ids), by_token)
    except Exception as e:  # (a carried window of ids that do not decode together)
        raise ValidationError(f"invalid stream_state: its window does not decode ({type(e).__name__})",
                              param="stream_state") from None
    finished = choice.finish_reason is not None
    shown = detokenizer.text_for_stream(finished)
    window, read_offset, num_tokens, stop_checked = detokenizer.carried()
    if len(window) > MAX_WINDOW or len(detokenizer.output_text) > MAX_TEXT:
        raise ValidationError("the reply's decode state outgrew what a stream_state carries", param="stream_state")
    sent = min(max(len(shown), state.sent), len(detokenizer.output_text))  # (a stop string cuts the text at the end)
    after = state.model_copy(update=dict(text=detokenizer.output_text, sent=sent,
                                         window=window, read_offset=read_offset, num_tokens=num_tokens,
                                         stop_checked=stop_checked, finished=finished))
    return state.text[:state.sent], shown[state.sent:], after


async def _decoded(serving: Any, params: SamplingParams, prompt_ids: list[int], state: DerenderStreamState | None,
                   choice: DerenderChoice) -> tuple[str, CompletionOutput, DerenderStreamState]:
    """(the text sent before this chunk, the chunk as the engine's output: its new text, tokens and logprobs
    decoded, the state after it), in the tokenizer thread (never on the event loop)."""
    eos, tokenizer = serving.engine.processor.eos_token_ids, serving.tokenizer

    def work() -> tuple[str, CompletionOutput, DerenderStreamState]:
        before, text, after = _detokenize(tokenizer, eos, prompt_ids, params, state, choice)
        return before, CompletionOutput(choice.index, text, list(choice.token_ids), None,
                                        logprob_entries(tokenizer, choice.logprobs), choice.finish_reason,
                                        choice.stop_reason), after

    return await serving.engine.in_tokenizer_thread(work)


def _usage(serving: Any, given: int | None, usage: dict[str, Any] | None) -> UsageInfo | None:
    """The chunk's usage (generate sends it on its last chunk, if asked), the prompt's count as sent."""
    if usage is None:
        return None
    completion = usage.get("completion_tokens")
    return serving.usage(prompt_tokens_of(given, usage), completion if isinstance(completion, int) else 0)


async def derender_chat_stream(chat: OpenAIServingChat, req: DerenderChatStreamRequest) -> dict[str, Any]:
    """One streamed chat chunk of one generate chunk, and the state for the next call."""
    _check_chunk(chat, req)
    context = await chat_context(chat, req.chat_request, req.model)  # (400 without chat_request where it is needed)
    if req.prompt_token_ids is None and (chat.reasoning_parser is not None or chat.tool_parser is not None):
        raise ValidationError("prompt_token_ids is required on a server with a tool or reasoning parser (whether "
                              "the prompt left the reasoning open)", param="prompt_token_ids")
    chunk, state, choices = req.generate_chunk, req.stream_state or DerenderStreamState(), []
    prompt_ids = list(req.prompt_token_ids or chunk.prompt_token_ids or context.prompt_ids)
    if chunk.choices:
        before, c, state = await _decoded(chat, context.params, prompt_ids, req.stream_state, chunk.choices[0])
        deltas = ChoiceDeltas(chat, context.run, hold_ids=False)
        deltas.resume(before)
        out = deltas.next(c, context.return_ids)
        if out is not None and chat.shown(context.run, out):
            if not state.role_sent:
                out.delta.role, state.role_sent = "assistant", True
            choices.append(out)
    first = req.stream_state is None and context.return_ids and not context.run.hide_reasoning
    body = ChatCompletionStreamResponse(id=f"chatcmpl-{chunk.request_id or 'derender'}", model=context.model,
                                        choices=choices, usage=_usage(chat, req.prompt_tokens, chunk.usage),
                                        prompt_token_ids=prompt_ids if first else None)  # (the first chunk's)
    return {"chunk": body.model_dump(), "stream_state": state.model_dump()}


async def derender_completion_stream(completion: OpenAIServingCompletion, req: DerenderCompletionStreamRequest
                                     ) -> dict[str, Any]:
    """One streamed completions chunk of one generate chunk, and the state for the next call."""
    _check_chunk(completion, req)
    context = completion_context(completion, req.completion_request, req.model)
    chunk, state, choices = req.generate_chunk, req.stream_state or DerenderStreamState(), []
    if chunk.choices:
        prompt_ids = list(req.prompt_token_ids or chunk.prompt_token_ids or [])
        _, c, state = await _decoded(completion, context.params, prompt_ids, req.stream_state, chunk.choices[0])
        lp = None if c.logprobs is None else completion.logprobs_of(c, state.text_offset, context.top_n, None,
                                                                    context.as_ids)
        if lp is not None:
            state.text_offset = completion.end_of(lp, state.text_offset)
        first = req.stream_state is None  # (the prompt's ids go with a choice's first chunk)
        choices.append(CompletionChoice(
            index=c.index, text=c.text, logprobs=lp, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            token_ids=list(c.token_ids) if context.return_ids else None,
            prompt_token_ids=prompt_ids if context.return_ids and first else None))
    body = CompletionResponse(id=f"cmpl-{chunk.request_id or 'derender'}", model=context.model, choices=choices,
                              usage=_usage(completion, req.prompt_tokens, chunk.usage))
    return {"chunk": body.model_dump(), "stream_state": state.model_dump()}
