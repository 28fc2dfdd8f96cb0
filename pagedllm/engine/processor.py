"""Turns user input (text, token ids, chat messages) into validated Requests."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pagedllm.config import DEFAULT_MAX_LOGPROBS
from pagedllm.engine.messages import AddBeamSearch, AddRequest
from pagedllm.engine.prompt_embeds import prompt_embeds_from_tensor
from pagedllm.errors import ValidationError
from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.prompt_embeds import PromptEmbeds
from pagedllm.request import Request
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, check_refs

if TYPE_CHECKING:
    from pagedllm.worker.structured_output import GrammarCompiler

#: Most top log-probabilities one request may ask for per token by default (EngineArgs.max_logprobs' default).
MAX_LOGPROBS = DEFAULT_MAX_LOGPROBS
#: What a pooling request carries as its sampling parameters: it never samples.
_NO_SAMPLING = SamplingParams(max_tokens=1)

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


class Processor:
    """Tokenizes and validates; everything it refuses raises ValidationError naming the parameter."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 grammars: Callable[[], GrammarCompiler] | None = None, max_logprobs: int = MAX_LOGPROBS,
                 embeds_hidden_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.embeds_hidden_size = embeds_hidden_size
        """The model's embedding width when prompts may be given as embeddings (enable_prompt_embeds); None: they
        are refused."""
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        """Most log-probabilities a request may ask for per token (ModelConfig.max_logprobs: -1 already resolved)."""
        self.eos_token_ids = eos_token_ids
        self._grammars = grammars
        """The structured-output compiler (shared with an in-process worker: one cache), made on the first
        constrained request; None: one of this processor's own."""

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

    def _embeds_request(self, request_id: str, prompt: dict[str, Any], params: Any, arrival_time: float,
                        lora_request: LoRARequest | None, seq_counter: Iterator[int]) -> AddRequest:
        """core_request of {"prompt_embeds": tensor}: the rows stand for the prompt's tokens (placeholder ids)."""
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
        if params.prompt_logprobs is not None:
            raise ValidationError("prompt_logprobs is not compatible with prompt_embeds (the prompt has no token ids "
                                  "to score)", param="prompt_logprobs", value=params.prompt_logprobs)
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

    def pooling_request(self, seq_id: str, prompt_ids: list[int], params: PoolingParams, arrival_time: float | None,
                        token_type_ids: list[int] | None) -> Request:
        """The Request of a pooling input, checked against max_model_len (a longer one is refused, naming
        ``input``: truncate_prompt_tokens cuts it instead)."""
        if len(prompt_ids) > self.max_model_len:
            raise ValidationError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the input has "
                f"{len(prompt_ids)} tokens: shorten it, or set truncate_prompt_tokens to cut it",
                param="input", value=len(prompt_ids))
        return Request(seq_id, prompt_ids, _NO_SAMPLING, (), 0, arrival_time, pooling_params=params,
                       token_type_ids=token_type_ids)

    def check_length(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The request's max_tokens once its length is checked against max_model_len."""
        if num_prompt_tokens >= self.max_model_len:
            raise ValidationError(
                f"prompt is {num_prompt_tokens} tokens long but max_model_len is {self.max_model_len} "
                "(at least one token must be generated)", param="prompt", value=num_prompt_tokens)
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
        return dataclasses.replace(params, **changes) if changes else params

    def check_params(self, params: SamplingParams) -> None:
        """The request's sampling parameters against the model and this engine's bounds (ValidationError naming
        the field); its bad words tokenized and its grammar compiled. Its logprobs are checked (and -1 resolved)
        by resolve_logprobs before, once: make_requests and prepare call it."""
        if not isinstance(params, SamplingParams):
            raise ValidationError.bad_value("sampling_params", params, "a SamplingParams")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", params.allowed_token_ids or []),
                          ("logprob_token_ids", params.logprob_token_ids or []),
                          ("reasoning_end_token_ids", params.reasoning_end_token_ids or []),
                          ("reasoning_forced_end_token_ids", params.reasoning_forced_end_token_ids or [])):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValidationError.bad_value(name, bad[0], f"a token id below {self.vocab_size}")
        if params.bad_words and params.bad_words_token_ids is None:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        if params.structured_outputs is not None:  # a bad schema / regex is refused here, before queueing
            if params.structured_outputs.json is not None:  # here, not in the compiler: never on the step loop
                check_refs(params.structured_outputs.json)
            self.grammars().compile(params.structured_outputs)

    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler (xgrammar is imported on the first constrained request)."""
        if self._grammars is None:
            from pagedllm.worker.structured_output import GrammarCompiler
            compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            self._grammars = lambda: compiler
        return self._grammars()

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's tokens as it would start the text and as it would follow a space (vLLM's way)."""
        texts = [t for word in words for t in (word.strip(), " " + word.strip())]
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []  # one batched call
        found: dict[tuple[int, ...], None] = {}  # insertion-ordered set: linear in the number of words
        for ids in encoded:
            if ids:
                found.setdefault(tuple(ids), None)
        return [list(ids) for ids in found]

    @staticmethod
    def needs_preparation(params: SamplingParams | Any) -> bool:
        """Whether ``prepare`` has work for these parameters (a grammar to compile, bad words to tokenize)."""
        return isinstance(params, SamplingParams) and (
            params.structured_outputs is not None or (bool(params.bad_words) and params.bad_words_token_ids is None))

    def prepare(self, params: SamplingParams) -> None:
        """The slow part of a request's checks, meant to run off the step loop (a worker thread): compiles its
        grammar into the shared cache (ValidationError if it does not compile) and tokenizes its bad words.
        The checks done when the request is queued then find both ready."""
        if isinstance(params, SamplingParams):
            self.resolve_logprobs(params)  # (its logprobs refused here too; make_requests resolves them for good)
        self.check_params(params)

    def make_requests(self, seq_ids: list[str], prompt_ids: list[int], params: SamplingParams,
                      arrival_time: float | None = None, cache_salt: str | None = None,
                      lora_request: LoRARequest | None = None,
                      prompt_embeds: PromptEmbeds | None = None) -> list[Request]:
        """One Request per sample (``params.n`` of them, one per id in ``seq_ids``); ``prompt_embeds``: the prompt
        as embeddings (``prompt_ids`` its placeholders)."""
        if isinstance(params, SamplingParams):
            params = self.resolve_logprobs(params)
        self.check_params(params)
        if prompt_embeds is not None:
            prompt_embeds = self.prompt_embeds(prompt_embeds)
            assert len(prompt_ids) == prompt_embeds.num_tokens, "one placeholder id per embedded row"
            if params.prompt_logprobs is not None:
                raise ValidationError("prompt_logprobs is not compatible with prompt_embeds", param="prompt_logprobs",
                                      value=params.prompt_logprobs)
        max_tokens = self.check_length(len(prompt_ids), params)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValidationError.bad_value("cache_salt", cache_salt, "a string")
        assert len(seq_ids) == params.n
        each = [params] if params.n == 1 else [params.child(i) for i in range(params.n)]
        return [Request(seq_id, prompt_ids, p, self.eos_token_ids, max_tokens, arrival_time, cache_salt, lora_request,
                        prompt_embeds=prompt_embeds)
                for seq_id, p in zip(seq_ids, each)]
