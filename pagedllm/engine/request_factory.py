"""The engine core's half of request processing: a tokenized request checked against the model and made into its
Requests (one per sample); the slow part of the checks (a grammar compiled, bad words tokenized) split out so
that it runs off the step loop (``prepare``)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagedllm.engine.processor import MAX_LOGPROBS, RequestLimits
from pagedllm.errors import ValidationError
from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.prompt_embeds import PromptEmbeds
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams, check_refs

if TYPE_CHECKING:
    from pagedllm.worker.structured_output import GrammarCompiler

#: What a pooling request carries as its sampling parameters: it never samples.
_NO_SAMPLING = SamplingParams(max_tokens=1)


class RequestFactory(RequestLimits):
    """Makes an engine core's Requests from the tokenized messages its front ends send."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int, eos_token_ids: tuple[int, ...],
                 grammars: Callable[[], GrammarCompiler] | None = None, max_logprobs: int = MAX_LOGPROBS,
                 embeds_hidden_size: int | None = None) -> None:
        super().__init__(max_model_len, vocab_size, eos_token_ids, max_logprobs, embeds_hidden_size)
        self.tokenizer = tokenizer
        """For bad words and a grammar compiler of this processor's own."""
        self._grammars = grammars
        """The structured-output compiler (shared with an in-process worker: one cache), made on the first
        constrained request; None: one of this processor's own."""

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
            prompt_embeds = self._checked_embeds(prompt_embeds, len(prompt_ids), params)
        max_tokens = self.check_length(len(prompt_ids), params)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValidationError.bad_value("cache_salt", cache_salt, "a string")
        assert len(seq_ids) == params.n
        each = [params] if params.n == 1 else [params.child(i) for i in range(params.n)]
        return [Request(seq_id, prompt_ids, p, self.eos_token_ids, max_tokens, arrival_time, cache_salt, lora_request,
                        prompt_embeds=prompt_embeds)
                for seq_id, p in zip(seq_ids, each)]

    def _checked_embeds(self, embeds: PromptEmbeds, num_placeholders: int, params: SamplingParams) -> PromptEmbeds:
        """A prompt given as embeddings, checked against the model (and against prompt_logprobs: no ids to score)."""
        embeds = self.prompt_embeds(embeds)
        assert num_placeholders == embeds.num_tokens, "one placeholder id per embedded row"
        if params.scores_prompt:
            name = "prompt_logprobs" if params.prompt_logprobs is not None else "prompt_logprob_token_ids"
            raise ValidationError(f"{name} is not compatible with prompt_embeds", param=name)
        return embeds
