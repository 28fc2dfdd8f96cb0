"""vLLM's scale-out render routes (--enable-scale-out or --tokens-only): POST /v1/chat/completions/render and
/v1/completions/render check and render a request exactly as /v1/chat/completions and /v1/completions would, and
answer the /inference/v1/generate request(s) that run it (its prompt's token ids, its sampling params under vLLM's
names) instead of running it. A render posted to generate as it is gives the reply's tokens (the round trip is
tested). What generate cannot carry is refused here with a 400 naming it, never dropped: a grammar that holds only
after the reasoning comes back as ``reasoning_ended: false`` (which generate refuses with a constraint), a request's
``watermarking: false`` and ``speculate: false`` are 400s."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from pagedllm.entrypoints.openai.limits import check_count, check_request_tokens, check_samples
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.protocol_tokens import UNSUPPORTED_SAMPLING, TokensSamplingParams
from pagedllm.entrypoints.openai.serving import counted_logprobs
from pagedllm.errors import ValidationError
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion

_CARRIED = [name for name in TokensSamplingParams.model_fields if name not in UNSUPPORTED_SAMPLING
            and name != "output_kind"]
"""Our SamplingParams fields a generate request's sampling_params carries (vLLM's names); output_kind is set by
generate from its own ``stream``."""


def generate_sampling(params: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """``params`` as generate's sampling_params (JSON): the fields it carries, ``max_tokens`` as the engine resolved
    it. What it cannot carry is a 400 naming the request's field."""
    if not params.watermarking:
        raise ValidationError("watermarking: false cannot be rendered (/inference/v1/generate does not take it)",
                              param="watermarking", value=False)
    if not params.speculate:
        raise ValidationError("speculate: false cannot be rendered (/inference/v1/generate does not take it)",
                              param="speculate", value=False)
    out: dict[str, Any] = {}
    for name in _CARRIED:
        value = getattr(params, name, None)
        if name == "structured_outputs" and value is not None:
            value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
        elif name == "logit_bias" and value is not None:
            value = {str(k): v for k, v in value.items()}  # (JSON keys: generate reads them back as ints)
        elif isinstance(value, tuple):
            value = list(value)
        if value is not None:
            out[name] = value
    out["max_tokens"] = max_tokens
    return out


async def render_chat(chat: OpenAIServingChat, req: ChatCompletionRequest, raw: Request | None = None
                      ) -> dict[str, Any]:
    """The generate request of a chat completion request (vLLM's GenerateRequest): the prompt's token ids, the
    sampling params, ``reasoning_ended`` (null without a reasoning parser; false where the reply starts inside the
    reasoning) and vLLM's ``parse_context`` (what a derenderer would parse the reply with)."""
    _refuse_unrendered(req)
    prep = await chat.prepare(req)
    params = prep.params
    max_tokens = chat.engine.processor.check_length(len(prep.prompt_ids), params)  # (as the engine checks it)
    reasoning_ended = None if prep.reasoning is None else not params.grammar_after_reasoning
    offsets = None if not req.return_token_offsets else await chat.engine.in_tokenizer_thread(
        token_offsets, chat.tokenizer, prep.text, prep.prompt_ids, False)  # (in the templated prompt's text)
    return {
        "request_id": chat.reply_id("chatcmpl", raw, req.request_id), "token_ids": prep.prompt_ids,
        "sampling_params": generate_sampling(params, max_tokens), "model": prep.model,
        "reasoning_ended": reasoning_ended, "stream": bool(req.stream),
        "stream_options": req.stream_options.model_dump() if req.stream and req.stream_options else None,
        "return_token_ids": req.return_token_ids, "token_offsets": offsets,
        "parse_context": {
            "tools": req.tools, "tool_choice": req.tool_choice, "parallel_tool_calls": req.parallel_tool_calls,
            "include_reasoning": req.include_reasoning,
            **({} if req.return_tokens_as_token_ids is None else  # (null: the server's default, left out as vLLM)
               {"return_tokens_as_token_ids": req.return_tokens_as_token_ids}),
            "chat_template_kwargs": req.chat_template_kwargs or {}}}


async def render_completion(completion: OpenAIServingCompletion, req: CompletionRequest,
                            raw: Request | None = None) -> list[dict[str, Any]]:
    """The generate requests of a completion request, one per prompt (vLLM's list of GenerateRequest); ids
    ``cmpl-<id>``, with ``-<i>`` per prompt where there are several."""
    _refuse_unrendered(req)
    for name, value, why in (("echo", req.echo, "the reply starts with the prompt"),
                             ("suffix", req.suffix, "not supported"),
                             ("prompt_embeds", req.prompt_embeds, "generate takes token ids")):
        if value not in (None, False, [], ""):
            raise ValidationError(f"{name} cannot be rendered ({why})", param=name, value=value)
    keep = completion.kept_tokens(req.truncate_prompt_tokens)
    if req.best_of is not None and req.best_of != req.n:
        raise ValidationError("best_of other than n is not supported", param="best_of", value=req.best_of)
    completion.check_model(req.model)
    completion.check_limits(req)
    if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
        check_count(req.prompt, completion.limits.max_prompts, "prompt", "--max-prompts")
    completion.check_prompt_size(req.prompt, "prompt")
    if req.prompt is None or req.prompt == "":
        raise ValidationError("prompt is required (and not empty)", param="prompt")
    prompts = await completion.tokenized(completion.prompts_of(req.prompt))
    offsets = await _completion_offsets(completion, prompts) if req.return_token_offsets else [None] * len(prompts)
    if keep is not None:  # (the kept tokens' offsets with them)
        offsets = [_cut(o, keep, req.truncation_side or "left") if o is not None else None for o in offsets]
        completion.truncate(prompts, keep, req.truncation_side or "left", None)
    check_samples(len(prompts), req.n or 1, completion.limits)
    params = completion.sampling_params(req, req.max_tokens, req.logprobs, req.stream, req.prompt_logprobs)
    lengths = [len(p["prompt_token_ids"]) for p in prompts]
    filled = [completion.engine.processor.check_length(n, params) for n in lengths]  # (as the engine checks it)
    check_request_tokens(completion.limits, completion.max_model_len, filled, req.n, req.stream,
                         counted_logprobs(req, req.logprobs), lengths, req.prompt_logprobs)
    base = completion.reply_id("cmpl", raw, req.request_id)
    stream_options = req.stream_options.model_dump() if req.stream and req.stream_options else None
    return [{"request_id": base if len(prompts) == 1 else f"{base}-{i}", "token_ids": list(p["prompt_token_ids"]),
             "sampling_params": generate_sampling(params, max_tokens), "model": req.model, "stream": bool(req.stream),
             "stream_options": stream_options, "return_token_ids": req.return_token_ids, "token_offsets": o}
            for i, (p, max_tokens, o) in enumerate(zip(prompts, filled, offsets))]


def token_offsets(tokenizer: Any, text: str, ids: list[int], add_special_tokens: bool) -> list[list[int]] | None:
    """Each of ``ids``' [start, end) characters in ``text`` (the tokenizer's offset mapping; a special token it
    added: [0, 0]), where it tokenizes ``text`` to exactly ``ids``; None where it cannot say (a slow tokenizer)."""
    try:
        encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    except NotImplementedError:  # (transformers' slow tokenizers have no offset mapping)
        return None
    if list(encoded["input_ids"]) != list(ids):
        return None
    return [list(span) for span in encoded["offset_mapping"]]


async def _completion_offsets(completion: OpenAIServingCompletion, prompts: list[dict[str, Any]]
                              ) -> list[list[list[int]] | None]:
    """return_token_offsets: each text prompt's token offsets in its text (a prompt of token ids has no text:
    None), in the tokenizer thread."""
    def work() -> list[list[list[int]] | None]:
        return [None if p["prompt"] is None else
                token_offsets(completion.tokenizer, p["prompt"], p["prompt_token_ids"], True) for p in prompts]

    return await completion.engine.in_tokenizer_thread(work)


def _cut(offsets: list[list[int]], keep: int, side: str) -> list[list[int]]:
    return offsets if len(offsets) <= keep else offsets[-keep:] if side == "left" else offsets[:keep]


def _refuse_unrendered(req: ChatCompletionRequest | CompletionRequest) -> None:
    """Fields a render cannot pass on (vLLM's render refuses beam search too)."""
    if getattr(req, "use_beam_search", False):
        raise ValidationError("beam search is not supported by the render endpoints", param="use_beam_search",
                              value=True)
