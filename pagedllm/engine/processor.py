"""The front end's input processing: user input (text, token ids, chat messages, embeddings) tokenized and checked
into the messages an engine core takes; ``RequestLimits``, the checks both sides share."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from pagedllm.config import DEFAULT_MAX_LOGPROBS
from pagedllm.engine.messages import AddBeamSearch, AddRequest, CoreReady
from pagedllm.engine.prompt_embeds import prompt_embeds_from_tensor
from pagedllm.errors import ValidationError
from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.prompt_embeds import PromptEmbeds
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

#: Most top log-probabilities one request may ask for per token by default (EngineArgs.max_logprobs' default).
MAX_LOGPROBS = DEFAULT_MAX_LOGPROBS

PromptType = str | dict[str, Any]


#: Names a chat_template_kwargs entry may not take: the rendering's own arguments and the template's messages (a
#: client could otherwise swap the conversation, its tools or the template, or make apply_chat_template tokenize).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "return_assistant_tokens_mask"})


def check_template_kwargs(kwargs: dict[str, Any] | None, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """``kwargs`` as the variables a chat template may see (a ValidationError naming ``param`` when it is not a
    mapping of names, or sets one of RESERVED_TEMPLATE_KWARGS); {} for None."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValidationError.bad_value(param, kwargs, "an object of template variables")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise ValidationError(f"{param} may not set {reserved[0]!r}: it is the request's own field or the "
                              f"rendering's (reserved: {sorted(RESERVED_TEMPLATE_KWARGS)})", param=param,
                              value=reserved[0])
    return dict(kwargs)


def render_chat(tokenizer: Any, conversation: list[dict[str, Any]], chat_template: str | None,
                add_generation_prompt: bool, tools: list[dict] | None = None, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """(prompt text, token ids) of a conversation through ``chat_template`` or the model's own template
    (which sees bos_token and the other special tokens; the text is then encoded without adding them
    again). ``continue_final_message``: the text ends inside the last message (no end of turn after it), for the
    model to go on with it; ``template_kwargs``: more variables the template sees (e.g. enable_thinking).
    ValidationError when there is no template, or the template refuses the messages."""
    from jinja2.exceptions import TemplateError

    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValidationError("this model has no chat template: pass one (chat_template= in LLM.chat, "
                              "--chat-template FILE for the server) or send plain prompts", param="chat_template")
    if continue_final_message and add_generation_prompt:
        raise ValidationError("continue_final_message and add_generation_prompt cannot both be true: set "
                              "add_generation_prompt to false to continue the last message",
                              param="continue_final_message")
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **(template_kwargs or {}))
    except TemplateError as e:  # the template itself refuses the conversation (e.g. role order)
        raise ValidationError(f"the chat template refused the messages: {e}", param="messages") from e
    except ValueError as e:  # continue_final_message: the last message's text is not where the template put it
        if not continue_final_message:
            raise
        raise ValidationError(f"continue_final_message: {e}", param="continue_final_message") from e
    return text, tokenizer.encode(text, add_special_tokens=False)


class RequestLimits:
    """What a request is checked against on both sides of the wire: the model's context length, its vocabulary and
    end-of-sequence ids, the logprobs bound, the width of prompts given as embeddings. Everything refused raises
    ValidationError naming the parameter."""

    def __init__(self, max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_logprobs: int = MAX_LOGPROBS, embeds_hidden_size: int | None = None) -> None:
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_logprobs = max_logprobs
        """Most log-probabilities a request may ask for per token (ModelConfig.max_logprobs: -1 already resolved)."""
        self.embeds_hidden_size = embeds_hidden_size
        """The model's embedding width when prompts may be given as embeddings (enable_prompt_embeds); None: they
        are refused."""

    def prompt_embeds(self, value: Any) -> PromptEmbeds:
        """A prompt's embeddings (a tensor, or PromptEmbeds already checked) checked against this model: enabled,
        1 .. max_model_len rows of its embedding width, a float dtype (ValidationError naming prompt_embeds)."""
        if self.embeds_hidden_size is None:
            raise ValidationError("prompt_embeds needs the engine started with enable_prompt_embeds "
                                  "(--enable-prompt-embeds)", param="prompt_embeds")
        embeds = value if isinstance(value, PromptEmbeds) else \
            prompt_embeds_from_tensor(value, self.max_model_len, self.embeds_hidden_size)
        if embeds.hidden_size != self.embeds_hidden_size:
            raise ValidationError(f"prompt_embeds has hidden size {embeds.hidden_size}, but this model's is "
                                  f"{self.embeds_hidden_size}", param="prompt_embeds", value=embeds.hidden_size)
        return embeds

    def check_length(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The request's max_tokens once its length is checked against max_model_len (and the prompt rows it
        scores against the prompt)."""
        if num_prompt_tokens >= self.max_model_len:
            raise ValidationError(
                f"prompt is {num_prompt_tokens} tokens long but max_model_len is {self.max_model_len} "
                "(at least one token must be generated)", param="prompt", value=num_prompt_tokens)
        _check_scored_rows(num_prompt_tokens, params)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt_tokens
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValidationError(
                f"this model's max_model_len is {self.max_model_len} tokens, but the request asks for "
                f"{num_prompt_tokens + max_tokens} ({num_prompt_tokens} prompt + {max_tokens} max_tokens)",
                param="max_tokens", value=max_tokens)
        return max_tokens

    def resolve_logprobs(self, params: SamplingParams) -> SamplingParams:
        """``params`` with logprobs / prompt_logprobs checked against max_logprobs (400 naming the field, in vLLM's
        words) and made counts the sampler takes: -1 ("every token", vLLM's) becomes the vocabulary size, a count
        above it the vocabulary size too (there are no more). A copy when anything changes: the caller's object
        is never edited."""
        changes = {}
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            value = getattr(params, name)
            if value is None or (name == "logprobs" and params.logprob_token_ids is not None):
                continue  # (logprob_token_ids: their count, bounded by MAX_LOGPROB_TOKEN_IDS)
            asked = self.vocab_size if value == -1 else value
            if asked > self.max_logprobs:
                raise ValidationError(f"Requested {what} logprobs of {asked}, which is greater than max allowed: "
                                      f"{self.max_logprobs} (the engine's max_logprobs, --max-logprobs; -1 asks for "
                                      f"the whole vocabulary, {self.vocab_size} tokens)", param=name, value=value)
            if min(asked, self.vocab_size) != value:
                changes[name] = min(asked, self.vocab_size)
        if params.prompt_logprob_token_ids is not None:
            changes["prompt_logprob_token_ids"] = self._id_rows(params.prompt_logprob_token_ids)
        return dataclasses.replace(params, **changes) if changes else params

    def _id_rows(self, rows: list[list[int]]) -> list[list[int]]:
        """prompt_logprob_token_ids bounded by the model (rows, ids per row, the vocabulary; in vLLM's words), then
        padded with -1 to one width (only after the bounds: the padded array is rows x widest row)."""
        name, width = "prompt_logprob_token_ids", max(map(len, rows))
        if len(rows) > self.max_model_len - 1:
            raise ValidationError(f"prompt_logprob_token_ids has {len(rows)} rows, but a prompt has at most "
                                  f"{self.max_model_len - 1} scored rows (max_model_len - 1)", param=name,
                                  value=len(rows))
        if width > self.max_logprobs:
            raise ValidationError(f"Requested {width} token ids per row in prompt_logprob_token_ids, which is greater "
                                  f"than max allowed: {self.max_logprobs} (--max-logprobs)", param=name, value=width)
        if any(t >= self.vocab_size for row in rows for t in row):
            raise ValidationError("prompt_logprob_token_ids contain out-of-vocab token ids (-1 pads a row). "
                                  f"Vocabulary size: {self.vocab_size}", param=name)
        return [row + [-1] * (width - len(row)) for row in rows]


class InputProcessor(RequestLimits):
    """The front end's half: tokenizes a user's prompt and turns a request into the message its engine core takes
    (``core_request``); the core's ``RequestFactory`` (engine/request_factory.py) makes the Requests of it."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 max_logprobs: int = MAX_LOGPROBS, embeds_hidden_size: int | None = None) -> None:
        super().__init__(max_model_len, vocab_size, eos_token_ids, max_logprobs, embeds_hidden_size)
        self.tokenizer = tokenizer

    @classmethod
    def for_core(cls, tokenizer: Any, ready: CoreReady) -> InputProcessor:
        """The processor of a front end whose engine core sent ``ready`` (its model's bounds)."""
        model = ready.config.model
        return cls(tokenizer, model.max_model_len, ready.vocab_size, tuple(ready.eos_token_ids),
                   max_logprobs=model.max_logprobs,
                   embeds_hidden_size=ready.hidden_size if model.enable_prompt_embeds else None)

    def tokenize_prompt(self, prompt: PromptType, truncate: int | None = None) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a string, {"prompt": ...} or {"prompt_token_ids": [...]}.

        ``truncate`` (a pooling request's truncate_prompt_tokens; -1: max_model_len): text is cut by the
        tokenizer to that many tokens (its truncation side, special tokens kept), token ids keep their last ones."""
        limit = None if truncate is None else (self.max_model_len if truncate == -1 else truncate)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in ids):
                raise ValidationError.bad_value("prompt_token_ids", ids, "a list of integers")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValidationError(
                    f"prompt_token_ids contains token id {bad[0]}, out of vocabulary (ids are in "
                    f"[0, {self.vocab_size}))",
                    param="prompt_token_ids", value=bad[0])
            text = prompt.get("prompt")
            if limit is not None:
                ids = ids[-limit:]
        else:
            text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
            if not isinstance(text, str):
                raise ValidationError.bad_value("prompt", prompt,
                                                "a string, {'prompt': str} or {'prompt_token_ids': [...]}")
            if not text:
                ids = []
            elif limit is None:
                ids = self.tokenizer.encode(text)
            else:
                ids = self.tokenizer(text, truncation=True, max_length=limit)["input_ids"]
        if not ids:
            raise ValidationError("prompt must not be empty", param="prompt", value=prompt)
        return text, list(ids)

    def core_request(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams,
                     arrival_time: float, lora_request: LoRARequest | None, seq_counter: Iterator[int]
                     ) -> tuple[str | None, AddRequest | AddBeamSearch]:
        """A front end's request as its engine core takes it: (prompt text, the tokenized request); a beam
        search with BeamSearchParams, else ``params.n`` samples, each id "n:request_id" with n from ``seq_counter``
        (front-made: users' ids can never collide with them)."""
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            return None, self._embeds_request(request_id, prompt, params, arrival_time, lora_request, seq_counter)
        if isinstance(params, PoolingParams):
            text, prompt_ids = self.tokenize_prompt(prompt, params.truncate_prompt_tokens)
            types = self.token_type_ids(prompt, len(prompt_ids))
            return text, AddRequest(request_id=request_id, seq_ids=[f"{next(seq_counter)}:{request_id}"],
                                    prompt_ids=prompt_ids, params=params, arrival_time=arrival_time,
                                    lora_request=lora_request, token_type_ids=types)
        text, prompt_ids = self.tokenize_prompt(prompt)
        if isinstance(params, BeamSearchParams):
            return text, AddBeamSearch(request_id=request_id, text=text, prompt_ids=prompt_ids, params=params,
                                       arrival_time=arrival_time, lora_request=lora_request)
        if not isinstance(params, SamplingParams):
            raise ValidationError.bad_value("sampling_params", params, "a SamplingParams")
        params = self.resolve_logprobs(params)  # (what the core and the front's output processor both read)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        seq_ids = [f"{next(seq_counter)}:{request_id}" for _ in range(params.n)]
        return text, AddRequest(request_id=request_id, seq_ids=seq_ids,
                                prompt_ids=prompt_ids, params=params, arrival_time=arrival_time,
                                cache_salt=cache_salt, lora_request=lora_request)

    def _embeds_request(self, request_id: str, prompt: dict[str, Any], params: Any, arrival_time: float,
                        lora_request: LoRARequest | None, seq_counter: Iterator[int]) -> AddRequest:
        """core_request of {"prompt_embeds": tensor}: the rows stand for the prompt's tokens (placeholder ids)."""
        _check_embeds_request(prompt, params)
        embeds = self.prompt_embeds(prompt["prompt_embeds"])
        params = self.resolve_logprobs(params)
        cache_salt = prompt.get("cache_salt")
        seq_ids = [f"{next(seq_counter)}:{request_id}" for _ in range(params.n)]
        return AddRequest(request_id=request_id, seq_ids=seq_ids, prompt_ids=embeds.placeholder_ids, params=params,
                          arrival_time=arrival_time, cache_salt=cache_salt, lora_request=lora_request,
                          prompt_embeds=embeds)

    @staticmethod
    def token_type_ids(prompt: PromptType, num_tokens: int) -> list[int] | None:
        """A tokenized pair's segment ids ({"prompt_token_ids": ..., "token_type_ids": ...}), cut as the ids were
        (their last ones); None when the prompt has none."""
        types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if types is None:
            return None
        if not isinstance(types, (list, tuple)) or "prompt_token_ids" not in prompt or \
                len(types) != len(prompt["prompt_token_ids"]) or any(t not in (0, 1) for t in types):
            raise ValidationError.bad_value("token_type_ids", types, "0s and 1s, one per prompt_token_ids entry")
        return list(types[len(types) - num_tokens:])


def _check_scored_rows(num_prompt_tokens: int, params: SamplingParams) -> None:
    """prompt_logprob_start inside the prompt's scored rows, and one prompt_logprob_token_ids row for each of them
    (vLLM's checks and words)."""
    start = params.prompt_logprob_start or 0
    if start and start >= num_prompt_tokens - 1:
        raise ValidationError(f"prompt_logprob_start must be less than prompt_len - 1 ({num_prompt_tokens - 1}) so at "
                              "least one prompt row is scored", param="prompt_logprob_start", value=start)
    rows = params.prompt_logprob_token_ids
    if rows is not None and len(rows) != max(num_prompt_tokens - 1 - start, 0):
        raise ValidationError(f"prompt_logprob_token_ids has {len(rows)} rows, but the prompt has "
                              f"{max(num_prompt_tokens - 1 - start, 0)} scored rows (prompt_len - 1 - "
                              "prompt_logprob_start)", param="prompt_logprob_token_ids", value=len(rows))


def _check_embeds_request(prompt: dict[str, Any], params: Any) -> None:
    """What a prompt given as embeddings refuses: other prompt fields, pooling and beam search (sampled generation
    only), prompt_logprobs (no token ids to score)."""
    extra = sorted(set(prompt) - {"prompt_embeds", "cache_salt"})
    if extra:
        raise ValidationError(f"a prompt given as prompt_embeds takes no {extra[0]} (give one or the other)",
                              param=extra[0])
    if isinstance(params, (PoolingParams, BeamSearchParams)):
        raise ValidationError("prompt_embeds is for sampled generation, not "
                              f"{'pooling' if isinstance(params, PoolingParams) else 'beam search'}",
                              param="prompt_embeds")
    if not isinstance(params, SamplingParams):
        raise ValidationError.bad_value("sampling_params", params, "a SamplingParams")
    if params.scores_prompt:
        name = "prompt_logprobs" if params.prompt_logprobs is not None else "prompt_logprob_token_ids"
        raise ValidationError(f"{name} is not compatible with prompt_embeds (the prompt has no token ids to score)",
                              param=name)
