"""Pydantic models of vLLM's token-in/token-out API (POST /inference/v1/generate, POST
/inference/v1/abort_requests; `pagedllm serve --enable-scale-out` or `--tokens-only`), with vLLM's field names.

The request's ``sampling_params`` is vLLM's ``SamplingParams`` as JSON. The fields it has that change nothing
here are accepted (vLLM ignores them the same way); the ones pagedllm cannot honour are accepted only at their
defaults and refused otherwise (400 naming ``sampling_params.<field>``), as are multimodal inputs and
disaggregated-serving parameters: nothing is silently dropped."""
from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, StrictInt, model_validator

from pagedllm.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
    OpenAIModel,
    PromptLogprob,
    StreamOptions,
    TokenIds,
    UsageInfo,
)
from pagedllm.errors import ValidationError

OutputMode = Literal["tokens", "text", "derender"]
"""vLLM's response levels: token ids only; also the detokenized text; a chat message (streamed: a delta) whose
content is that text (on a server with a tool or reasoning parser: parsed as chat parses it, with the request's
parse_context, and not streamed)."""

MAX_REQUEST_ID_CHARS = 1024
"""Longest request_id (and X-Request-Id) taken: it is kept while the request runs and echoed in every chunk."""

UNSUPPORTED_SAMPLING = {
    "watermarking": None,
    "skip_clone": False, "extra_args": None, "skip_reading_prefix_cache": None, "thinking_token_budget": None,
    "repetition_detection": None, "routed_experts_prompt_start": 0, "trace_decode_token_ids": None,
    "truncate_prompt_tokens": None, "output_text_buffer_length": 0, "logits_processors": None,
}
"""vLLM SamplingParams fields pagedllm does not implement here -> the default a request may send (a client that
serializes every field sends them); any other value is refused with a 400 naming it."""


class TokensSamplingParams(OpenAIModel):
    """vLLM's SamplingParams as the generate request carries it (unknown keys refused)."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    """Stop strings: need detokenize (and are refused on a --tokens-only server, which never detokenizes)."""
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    max_tokens: int | None = None
    """Omitted or null: the rest of the context (vLLM fills an omitted one the same way)."""
    min_tokens: int = 0
    logprobs: int | None = None
    """Alternatives per generated token (-1: the whole vocabulary, as vLLM)."""
    prompt_logprobs: int | None = None
    logprob_token_ids: TokenIds | None = None
    flat_logprobs: StrictBool = False
    """vLLM's in-process container choice: the JSON is the same either way."""
    detokenize: StrictBool = True
    """False: only token ids are wanted (output_mode "tokens"); stop strings then cannot be checked (400)."""
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    """Only true with output_mode "text" (pagedllm's detokenizer always puts them); tokens carry no text."""
    include_stop_str_in_output: StrictBool = False
    output_kind: int | None = None
    """Set by the server from ``stream`` (as vLLM does, whatever the request says)."""
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict | None = None
    """One of {"json": schema}, {"regex": ...}, {"choice": [...]}, {"grammar": ebnf}, {"json_object": true}."""
    watermarking: Any = None
    prompt_logprob_token_ids: list[list[StrictInt]] | None = None
    """Per scored prompt row, the token ids whose log-probabilities it returns (``prompt_token_id_logprobs``)."""
    prompt_logprob_start: int | None = None
    """The first prompt row scored by prompt_logprobs and prompt_logprob_token_ids."""
    stream_interval: int | None = Field(default=None, ge=1)
    """Streamed: each chunk gathers this many tokens (the first and last at once); at least --stream-interval."""
    skip_clone: Any = False
    extra_args: Any = None
    skip_reading_prefix_cache: Any = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None
    routed_experts_prompt_start: Any = 0
    trace_decode_token_ids: Any = None
    truncate_prompt_tokens: Any = None
    output_text_buffer_length: Any = 0
    logits_processors: Any = None

    @model_validator(mode="after")
    def _refused(self) -> TokensSamplingParams:
        for name, default in UNSUPPORTED_SAMPLING.items():
            if getattr(self, name) != default:
                raise ValidationError(f"sampling_params.{name} is not supported by this server (it is not ignored: "
                                      f"the request is refused; send {default!r} or leave it out)",
                                      param=f"sampling_params.{name}")
        if self.stop and not self.detokenize:
            raise ValidationError("stop strings are only supported when sampling_params.detokenize is true",
                                  param="sampling_params.stop")
        return self


class GenerateRequest(OpenAIModel):
    """POST /inference/v1/generate: token ids in, token ids (and, with output_mode "text", text) out."""

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex, min_length=1,
                            max_length=MAX_REQUEST_ID_CHARS)
    """The reply's id is "generate-tokens-<request_id>" (or of the X-Request-Id header): what abort_requests takes."""
    token_ids: TokenIds = Field(min_length=1)
    token_offsets: list[tuple[int, int]] | None = None
    """vLLM's /render metadata (character offsets of each token): read by nothing at generation, as in vLLM."""
    features: dict | None = None
    """Multimodal features: refused (this server generates from text tokens only)."""
    content_parts: list[dict] | None = None
    """Multimodal content: refused (this server generates from text tokens only)."""
    sampling_params: TokensSamplingParams
    model: str | None = None
    reasoning_ended: StrictBool | None = None
    """Only matters with structured outputs: false (the reply starts inside the reasoning, as /render says) holds the
    grammar until the reasoning ends, as the chat route does (needs --reasoning-parser, else a 400)."""
    reasoning_parser_kwargs: dict | None = None
    """Only matters with structured outputs (vLLM's engine-side reasoning parser): refused with them."""
    return_token_ids: StrictBool | None = None
    """The prompt's token ids in the reply (streamed: in the first chunk)."""
    output_mode: OutputMode = "tokens"
    parse_context: dict | None = None
    """vLLM's /render context (tools, tool_choice, parallel_tool_calls, include_reasoning, chat_template_kwargs):
    with output_mode "derender" on a server with a tool or reasoning parser, the reply is parsed with it as the chat
    route parses (required there; read by nothing otherwise)."""
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = 0
    """Only 0: this server schedules first come, first served (vLLM refuses others without priority scheduling)."""
    kv_transfer_params: dict | None = None
    """Disaggregated serving: refused (this server has no KV connector)."""
    ec_transfer_params: dict | None = None
    """Encoder-cache disaggregation: refused."""

    @model_validator(mode="after")
    def _check(self) -> GenerateRequest:
        if any(t < 0 for t in self.token_ids):
            raise ValidationError("token_ids must not contain negative values", param="token_ids")
        for name in ("features", "content_parts"):
            if getattr(self, name):
                raise ValidationError(f"{name}: multimodal inputs are not supported by this server (it generates "
                                      "from text token ids only)", param=name)
        for name in ("kv_transfer_params", "ec_transfer_params"):
            if getattr(self, name) is not None:
                raise ValidationError(f"{name} is not supported by this server (no disaggregated serving: it is "
                                      "not ignored, the request is refused)", param=name)
        if self.priority != 0:
            raise ValidationError("priority other than 0 is not supported: this server does not use priority "
                                  "scheduling", param="priority")
        if self.output_mode != "tokens" and not self.sampling_params.detokenize:
            raise ValidationError(f"output_mode={self.output_mode!r} requires sampling_params.detokenize to be "
                                  "true", param="sampling_params.detokenize")
        constrained = self.sampling_params.structured_outputs is not None
        if constrained and self.reasoning_parser_kwargs:
            raise ValidationError("reasoning_parser_kwargs are not supported (the template variables the reasoning "
                                  "parser reads come in parse_context.chat_template_kwargs, as /render answers them)",
                                  param="reasoning_parser_kwargs")
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise ValidationError("stream_options can only be given with stream=true", param="stream_options")
        if self.stream and self.sampling_params.prompt_logprobs is not None:
            raise ValidationError("prompt_logprobs cannot be streamed", param="sampling_params.prompt_logprobs")
        if self.stream and self.sampling_params.prompt_logprob_token_ids is not None:
            raise ValidationError("prompt_logprob_token_ids cannot be streamed",
                                  param="sampling_params.prompt_logprob_token_ids")
        if self.output_mode == "text" and not self.sampling_params.spaces_between_special_tokens:
            raise ValidationError("sampling_params.spaces_between_special_tokens=false is not supported with "
                                  "output_mode='text'", param="sampling_params.spaces_between_special_tokens")
        return self


class AbortRequestsRequest(OpenAIModel):
    """POST /inference/v1/abort_requests: the ids of generate replies (their request_id) to end now."""

    request_ids: str | list[str] = Field(max_length=1024)


class GenerateLogProb(BaseModel):
    """One candidate token at a position: its id (no tokenizer needed), log-probability and rank."""

    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    """The sampled token at one position, then its candidates (the sampled one first, then by rank)."""

    top_logprobs: list[GenerateLogProb] = Field(default_factory=list)


class GenerateLogProbs(BaseModel):
    content: list[GenerateLogProbsContent] | None = None


class GenerateChoice(BaseModel):
    """One sample of the reply (streamed: its new tokens in this chunk). ``text`` only with output_mode "text",
    ``message`` (streamed: ``delta``) only with "derender"; routed_experts, sampling_mask and weight_versions are
    vLLM's and always null here."""

    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[Any] | None = None
    logprobs: GenerateLogProbs | ChatLogprobs | None = None
    text: str | None = None
    message: ChatResponseMessage | None = None
    delta: DeltaMessage | None = None


class GenerateResponse(BaseModel):
    """The whole reply (stream=false)."""

    request_id: str
    model: str | None = None
    created: int | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    prompt_token_id_logprobs: str | None = None
    prompt_token_ids: list[int] | None = None
    mm_placeholders: dict | None = None
    metrics: dict | None = None
    kv_transfer_params: dict | None = None
    ec_transfer_params: dict | None = None
    output_mode: OutputMode = "tokens"
    choices: list[GenerateChoice]


class GenerateStreamResponse(BaseModel):
    """One chunk of a streamed reply: one choice's news (or, last, no choice and the usage)."""

    request_id: str
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    """With return_token_ids: in the first chunk only (absent from the others)."""
    output_mode: OutputMode = "tokens"
    choices: list[GenerateChoice]

