"""Pydantic models of the OpenAI API (and vLLM's extra sampling fields) that the server speaks."""
from __future__ import annotations

import contextlib
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictInt,
    model_serializer,
    model_validator,
)
from pydantic import ValidationError as PydanticValidationError

from pagedllm.errors import ValidationError

TokenIds = list[StrictInt]
"""A list of token ids: integers only (JSON's true is not token 1)."""


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # a field we do not implement is refused (400 naming it), never silently dropped, as OpenAI's
    # own API answers an unrecognized request argument; a flag is a StrictBool: JSON true or false only (pydantic's
    # lax bool would take "yes", "off" or 1, which OpenAI's API refuses)
    model_config = ConfigDict(extra="forbid")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: StrictBool = False
    """A last chunk with the request's usage (and no choices) before [DONE]."""
    continuous_usage_stats: StrictBool = False
    """vLLM's extra, with include_usage: every chunk also carries its choice's usage so far (guidellm asks)."""

    @property
    def every_chunk(self) -> bool:
        """Whether each chunk carries usage."""
        return self.include_usage and self.continuous_usage_stats


class SamplingFields(OpenAIModel):
    """Sampling fields shared by completions and chat (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    return_token_offsets: StrictBool = False
    """The render routes' (vLLM's): each prompt token's [start, end) characters in the prompt's text (chat: the
    templated prompt's); a 400 on the routes that run a request."""
    request_id: str | None = Field(default=None, max_length=1024)
    """vLLM's: the reply's id is "<prefix>-<request_id>" (an X-Request-Id header wins); the engine's own ids stay
    the server's, so two clients' equal ids never collide."""
    stream_interval: int | None = Field(default=None, ge=1)
    """vLLM's: a streamed reply's chunks gather this many tokens each (its first and last at once); raised to
    the server's --stream-interval when below it."""
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    """{"type": "text"} (default), {"type": "json_object"}, or {"type": "json_schema", "json_schema":
    {"schema": ...}}."""
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: StrictBool = False
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    """vLLM's extra: logprobs name each token "token_id:<id>" rather than its text (default: the server's
    --return-tokens-as-token-ids)."""
    logprob_token_ids: TokenIds | None = None
    """vLLM's extra, with logprobs: each generated position lists the log-probabilities of exactly these tokens
    (and the sampled one), in place of the top ones (top_logprobs / logprobs); at most 128 ids."""
    structured_outputs: dict | None = None
    """vLLM's extra: one of {"json": schema}, {"regex": ...}, {"choice": [...]}, {"grammar": ebnf},
    {"json_object": true}."""
    # ours
    speculate: StrictBool = True
    """With a server started with --speculative-config: false opts this request out of speculation."""
    watermarking: StrictBool | None = None
    """vLLM's extra: with a server started with --watermark-config, false opts this request out of the watermark
    (unless the config enforces it); true on a server without one is refused."""


class CompletionRequest(SamplingFields):
    prompt: str | TokenIds | list[str] | list[TokenIds] | None = None
    """Required and not "" (checked with prompt_embeds, as vLLM: a 400 naming prompt)."""
    prompt_embeds: str | list[str] | None = None
    """vLLM's extra (needs --enable-prompt-embeds): prompts given as embeddings, each the base64 of a torch.save'd
    (num_tokens, hidden_size) float tensor; their choices come first, then prompt's. [] is none given."""
    max_tokens: int | None = 16
    echo: StrictBool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None
    use_beam_search: StrictBool = False
    """vLLM's extra: beam search with n beams; the n best sequences are the choices."""
    prompt_logprobs: int | None = None
    """vLLM's extra: the prompt tokens' log-probabilities (and the top-N) in each choice."""
    length_penalty: float = 1.0
    return_token_ids: StrictBool | None = None
    """vLLM's extra: each choice carries its prompt's token ids and the ids it generated (prompt_token_ids,
    token_ids; streamed: the prompt's in a choice's first chunk, each chunk's new ids)."""
    truncate_prompt_tokens: int | None = None
    """vLLM's extra: each prompt keeps at most this many of its tokens (-1: max_model_len - 1, a token left for the
    reply); a shorter prompt is kept whole. 1 to max_model_len, or -1 (a 400 naming it otherwise)."""
    truncation_side: Literal["left", "right"] | None = None
    """vLLM's extra: which end truncate_prompt_tokens cuts: "left" (the default, as vLLM's for generating models)
    keeps the prompt's last tokens, "right" its first."""

    @model_validator(mode="after")
    def _a_prompt(self) -> CompletionRequest:
        """A prompt or prompt_embeds (vLLM's words: its clients match them)."""
        if (self.prompt is None or self.prompt == "") and not self.prompt_embeds:
            raise ValidationError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt",
                                  value=self.prompt)
        return self


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class MessageFunctionCall(OpenAIModel):
    """An assistant message's legacy (pre-tools) ``function_call``."""

    name: str
    arguments: str


class ChatMessage(BaseModel):
    """One message of a conversation. Unlike the request around it, a message ignores keys it does not know, as
    vLLM's does: clients append the reply objects they got (the openai SDK's ``model_dump()`` adds ``refusal``,
    ``annotations``, ``audio``, ``function_call``...), so every field of our replies and OpenAI's is read here."""

    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    """An assistant message's earlier tool calls (passed to the chat template)."""
    tool_call_id: str | None = None
    """A "tool" message: the call it answers."""
    reasoning_content: str | None = None
    """An assistant message's reasoning (our replies' field with --reasoning-parser): passed to the chat template
    (as reasoning_content and reasoning), which shows it or drops it as the model was trained to."""
    reasoning: str | None = None
    """vLLM 0.34's name of reasoning_content (the same; a message with both: this one, as vLLM)."""
    refusal: str | None = None
    """OpenAI's replies: the assistant's refusal, its words when content is empty."""
    function_call: MessageFunctionCall | None = None
    """The legacy form of one tool call (passed to the chat template as one of tool_calls)."""
    annotations: list[dict] | None = None
    """OpenAI's replies: citations about the reply's text, not part of the conversation (dropped)."""
    audio: dict | None = None
    """OpenAI's replies: a spoken reply's id; only null is accepted (this server has no audio)."""


class ToolChoiceFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    """tool_choice naming one function: {"type": "function", "function": {"name": ...}}."""

    type: Literal["function"]
    function: ToolChoiceFunction


def _tool_choice(value: object) -> object:
    """tool_choice in one of its shapes, or one error naming them all (pydantic's own names each union member)."""
    if value is None or isinstance(value, NamedToolChoice) or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict):
        with contextlib.suppress(PydanticValidationError):
            return NamedToolChoice.model_validate(value)
    raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                     '{"name": ...}}')


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None, BeforeValidator(_tool_choice)]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    tools: list[dict] | None = None
    tool_choice: ToolChoice = None
    """"none", "auto" (needs --tool-call-parser), "required" or {"type": "function", "function": {"name": ...}};
    default: "auto" with tools and a parser, else "none"."""
    parallel_tool_calls: StrictBool = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    """vLLM's extra: the last message (an assistant's prefill) is continued: no end of turn after it, no new turn
    opened; needs add_generation_prompt false."""
    echo: StrictBool = False
    """vLLM's extra: the reply's content starts with the last message's, where that message has the reply's role
    (the assistant's, or the last message's own with add_generation_prompt false)."""
    chat_template: str | None = None
    """vLLM's extra: a Jinja chat template for this request (refused unless the server runs with
    --trust-request-chat-template)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's extra: more variables the chat template sees, e.g. {"enable_thinking": false} (Qwen3)."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    """OpenAI's: the chat template's reasoning_effort, and its enable_thinking (false for "none") unless
    chat_template_kwargs sets it, as vLLM passes it; a template without them ignores it."""
    include_reasoning: StrictBool = True
    """vLLM's extra: false leaves the reasoning out of the reply (with --reasoning-parser: no reasoning_content,
    and no logprobs or token ids, which would show it)."""
    thinking_token_budget: StrictInt | None = None
    """vLLM's extra: most tokens generated inside the reasoning section; once spent, its end marker is forced
    (needs --reasoning-parser; -1: no cap)."""
    prompt_logprobs: int | None = None
    """vLLM's extra: the rendered conversation's tokens' log-probabilities (and the top-N), in the reply's
    prompt_logprobs; not streamed."""
    return_token_ids: StrictBool | None = None
    """vLLM's extra: the reply carries the rendered conversation's token ids (prompt_token_ids) and each choice
    the ids it generated (token_ids; streamed: the prompt's in the first chunk, each chunk's new ids)."""


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache (their K/V not computed again)."""


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    """Generated tokens inside the reasoning sections (their markers not counted)."""


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    """Chat and completions: set with --enable-prompt-tokens-details (as vLLM), else null."""
    completion_tokens_details: CompletionTokensDetails | None = None
    """Chat with --reasoning-parser (as vLLM): the reasoning tokens among the completion tokens; else null."""
    cached_tokens: int = Field(default=0, exclude=True)
    """Prompt tokens found in the prefix cache: in chat's and completions' JSON only as prompt_tokens_details; the
    Responses and Messages APIs report it always (cached_tokens, cache_read_input_tokens)."""


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    _end: int = PrivateAttr(default=0)
    """The text offset after the last token (not in the JSON; tokens may be named "token_id:<id>", not by text)."""


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    """vLLM's shape: per prompt position (None first), token id -> its log-probability."""
    prompt_token_ids: list[int] | None = None
    """With return_token_ids: the prompt's token ids (streamed: in the choice's first chunk)."""
    token_ids: list[int] | None = None
    """With return_token_ids: the token ids generated (streamed: this chunk's)."""


class _OmitsNoneKeys(BaseModel):
    """A reply whose keys in ``_omitted_if_none`` are left out of the JSON while None (vLLM sends no such key)."""

    _omitted_if_none: ClassVar[tuple[str, ...]] = ("metrics",)

    @model_serializer(mode="wrap")
    def _omit_none_keys(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = handler(self)
        for key in self._omitted_if_none:
            if data.get(key) is None:
                data.pop(key, None)
        return data


class CompletionResponse(_OmitsNoneKeys):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    metrics: PerRequestMetrics | None = None
    """--enable-per-request-metrics (one prompt, n = 1): the request's timing (streamed: on the usage chunk); no key
    without it."""
    kv_transfer_params: dict[str, Any] | None = None
    """Only a derendered reply's: the generate reply's own, passed through (no key otherwise, as vLLM)."""
    _omitted_if_none: ClassVar[tuple[str, ...]] = ("metrics", "kv_transfer_params")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None
    """Streamed deltas only: the call's position."""


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None
    """With --reasoning-parser: the model's <think> part (vLLM's field)."""

    @model_serializer(mode="wrap")
    def _without_empty_calls(self, handler: SerializerFunctionWrapHandler) -> dict:
        """No tool_calls key when there are none, as OpenAI and vLLM answer (the SDK then reads None); the
        reasoning under both its names (vLLM 0.34's ``reasoning``, and ``reasoning_content`` that clients of
        older vLLMs read)."""
        return _with_both_reasoning_names(handler(self))


def _with_both_reasoning_names(data: dict) -> dict:
    """A message or delta as JSON: no empty tool_calls, ``reasoning`` beside ``reasoning_content``."""
    if not data.get("tool_calls"):
        data.pop("tool_calls", None)
    if "reasoning_content" in data:
        data["reasoning"] = data["reasoning_content"]
    return data


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """With return_token_ids: the token ids generated."""


class PerRequestMetrics(BaseModel):
    """vLLM's per-request timing (--enable-per-request-metrics), in milliseconds; a figure whose timestamps are
    missing (mean_itl_ms of a one-token reply) is left out of the JSON."""

    time_to_first_token_ms: float | None = None
    """First scheduled -> first token."""
    generation_time_ms: float | None = None
    """First token -> last token (the decode alone)."""
    queue_time_ms: float | None = None
    """Arrival -> first scheduled."""
    mean_itl_ms: float | None = None
    """generation_time_ms over the tokens after the first (two tokens or more)."""
    tokens_per_second: float | None = None
    """Generated tokens over first scheduled -> last token (the prefill counted)."""

    @model_serializer(mode="wrap")
    def _known_only(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponse(_OmitsNoneKeys):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    """With prompt_logprobs (vLLM's extra): per rendered-prompt position (None first), token id -> its
    log-probability, as completions' choices carry them."""
    prompt_token_ids: list[int] | None = None
    """With return_token_ids: the rendered conversation's token ids."""
    metrics: PerRequestMetrics | None = None
    """--enable-per-request-metrics (n = 1): the request's timing; no key without it."""
    kv_transfer_params: dict[str, Any] | None = None
    """Only a derendered reply's: the generate reply's own, passed through (no key otherwise, as vLLM)."""
    _omitted_if_none: ClassVar[tuple[str, ...]] = ("metrics", "kv_transfer_params")


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _names(self, handler: SerializerFunctionWrapHandler) -> dict:
        """As a message's: no empty tool_calls, the reasoning as ``reasoning`` too (vLLM 0.34's name)."""
        return _with_both_reasoning_names(handler(self))


class ChatStreamChoice(_OmitsNoneKeys):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    """With return_token_ids: the token ids this chunk adds; no key otherwise, nor in the role's first chunk (as
    vLLM's, whose SDK clients test for the key)."""
    _omitted_if_none: ClassVar[tuple[str, ...]] = ("token_ids",)


class ChatCompletionStreamResponse(_OmitsNoneKeys):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    """With return_token_ids: the rendered conversation's token ids, in the first chunk (no key in the others,
    as vLLM's)."""
    metrics: PerRequestMetrics | None = None
    """--enable-per-request-metrics (n = 1): the request's timing, on the last (usage) chunk only."""
    _omitted_if_none: ClassVar[tuple[str, ...]] = ("prompt_token_ids", "metrics")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    """For a LoRA adapter: the base model it runs over."""
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    """messages: end with the template's opening of the assistant's turn."""
    continue_final_message: StrictBool = False
    """messages: end inside the last message (as chat's continue_final_message; add_generation_prompt false)."""
    chat_template: str | None = None
    """messages: a Jinja chat template (needs --trust-request-chat-template)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """messages: more variables for the chat template (as chat's)."""
    tools: list[dict] | None = None
    """messages: the tools the template shows (as chat's, checked against the same limits)."""
    return_token_strs: StrictBool = False
    """vLLM's: the reply also lists each token as the tokenizer's string (token_strs)."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None
    """With return_token_strs: each token's string in the vocabulary."""


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str




class LoadLoRAAdapterRequest(OpenAIModel):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str
    load_inplace: StrictBool = False
    """An adapter already loaded under lora_name is replaced (else that is a 400)."""


class UnloadLoRAAdapterRequest(OpenAIModel):
    """vLLM's /v1/unload_lora_adapter body (lora_int_id is accepted and must match, if given)."""

    lora_name: str
    lora_int_id: int | None = None
