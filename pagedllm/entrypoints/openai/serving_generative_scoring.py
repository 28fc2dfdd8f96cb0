"""POST /generative_scoring: vLLM's Generative Scoring API on a generative model. Each item is put after the query
(before it with ``item_first``) and the model reads the next position once: one generated token whose
log-probabilities are taken for exactly the ``label_token_ids`` (the sampler's logprob_token_ids, raw
log-softmax of the logits). An item's score is the first label's probability, normalised over the labels
(``apply_softmax``, the default) or over the whole vocabulary (``apply_softmax: false``). Every size a client
controls is checked (400 naming the field) before anything is tokenized or queued."""
from __future__ import annotations

import math
import time
from typing import Literal

from pydantic import BaseModel, Field, StrictBool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.engine.processor import PromptType
from pagedllm.entrypoints.openai.limits import check_count
from pagedllm.entrypoints.openai.protocol import OpenAIModel, TokenIds, UsageInfo, random_id
from pagedllm.entrypoints.openai.serving import OpenAIServing, RequestFailedError
from pagedllm.errors import ValidationError, quoted
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import MAX_LOGPROB_TOKEN_IDS, RequestOutputKind, SamplingParams

GONE = 499
"""The status of a request whose client left before its answer (nobody reads it)."""

MAX_CACHE_SALT_CHARS = 128
"""Most characters of a cache_salt (vLLM's bound)."""
CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")
"""Characters vLLM refuses in a cache_salt (refused here too: the same requests pass or fail on both)."""
MAX_REQUEST_ID_CHARS = 256
"""Most characters of a client's request_id (it is echoed in the response's id)."""


class GenerativeScoringRequest(OpenAIModel):
    """vLLM's generative scoring request (an unknown field is a 400 naming it)."""

    model: str | None = None
    query: str | TokenIds
    """The query: text, or token ids."""
    items: list[str] | list[TokenIds]
    """The items scored against the query: all texts or all token-id lists."""
    label_token_ids: TokenIds
    """The tokens read at the next position; the score is the first one's probability."""
    apply_softmax: StrictBool = True
    """True: the labels' probabilities normalised over the labels alone; false: the model's own (over the whole
    vocabulary)."""
    item_first: StrictBool = False
    """The item before the query (default: the query first)."""
    add_special_tokens: StrictBool = True
    """A text query tokenized with the tokenizer's special tokens (a BOS); item texts never take them."""
    cache_salt: str | None = None
    """Salts the prefix cache of every item's prompt (requests with other salts share no blocks)."""
    priority: int = 0
    """vLLM's: only 0 (this server does not schedule by priority)."""
    request_id: str | None = None
    """Named in the response's id (``generative-scoring-<request_id>``); default a random one."""


class GenerativeScoringItemResult(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class GenerativeScoringResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[GenerativeScoringItemResult]
    usage: UsageInfo


def check_cache_salt(cache_salt: str | None) -> None:
    """A cache_salt by vLLM's rule: non-empty, at most MAX_CACHE_SALT_CHARS, none of CACHE_SALT_FORBIDDEN (400)."""
    if cache_salt is not None and (not cache_salt or len(cache_salt) > MAX_CACHE_SALT_CHARS
                                   or any(c in cache_salt for c in CACHE_SALT_FORBIDDEN)):
        raise ValidationError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                              "characters without '@', '/', '\\' or NUL", param="cache_salt", value=cache_salt)


def check_request_fields(priority: int, cache_salt: str | None, request_id: str | None) -> None:
    """The fields vLLM's scoring and decisions requests share (400 naming the field): priority 0 only, cache_salt
    (vLLM's rule) and request_id within their bounds."""
    if priority != 0:
        raise ValidationError.bad_value("priority", priority, "0 (this server does not schedule by priority)")
    check_cache_salt(cache_salt)
    if request_id is not None and not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise ValidationError(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} characters", param="request_id",
                              value=request_id)


def label_probabilities(logprobs: list[float], apply_softmax: bool) -> list[float]:
    """The labels' probabilities from their log-probabilities: a softmax over them alone (``apply_softmax``;
    computed from the largest, so that very small log-probabilities do not underflow to 0/0), else each one's
    exp (the model's probability over the whole vocabulary). Labels that can all never be chosen (-inf each)
    share the mass equally under the softmax."""
    if not apply_softmax:
        return [math.exp(lp) for lp in logprobs]
    top = max(logprobs)
    if top == float("-inf"):
        return [1.0 / len(logprobs)] * len(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    return [w / total for w in weights]


class OpenAIServingGenerativeScoring(OpenAIServing):
    """/generative_scoring over the completion endpoints' machinery (limits, admission, LoRA, timeouts)."""

    async def score(self, req: GenerativeScoringRequest, raw: Request) -> Response:
        """Each item's score, in item order, and the request's usage (prompt tokens of every item, one generated
        token each)."""
        model, lora = self.check_model(req.model)
        labels = self._labels(req.label_token_ids)
        self._check_fields(req)
        self._check_waiting(req.items)  # (a full queue sheds it before it is tokenized)
        prompts = await self._prompts(req)
        request_id = random_id("generative-scoring")  # (the engine's ids are the server's own, never a client's)
        read = await self.read_labels(request_id, prompts, labels, lora, raw, "items")
        if read is None:
            return Response(status_code=GONE)  # the client went away
        outputs, logprobs = read
        data = [GenerativeScoringItemResult(index=i, score=label_probabilities(lps, req.apply_softmax)[0])
                for i, lps in enumerate(logprobs)]
        usage = self.usage(sum(len(o.prompt_token_ids) for o in outputs),
                           sum(len(c.token_ids) for o in outputs for c in o.outputs),
                           sum(max(o.num_cached_tokens, 0) for o in outputs))
        if req.request_id is not None:
            request_id = f"generative-scoring-{req.request_id}"
        body = GenerativeScoringResponse(id=request_id, model=model, data=data, usage=usage)
        return JSONResponse(body.model_dump())

    # ------------------------------------------------------------------ request checks
    def _labels(self, ids: list[int]) -> list[int]:
        """The label ids, each listed once in their first order: 1 to MAX_LOGPROB_TOKEN_IDS ids of the
        vocabulary (400 naming label_token_ids)."""
        vocab = self.engine.processor.vocab_size
        check_count(ids, MAX_LOGPROB_TOKEN_IDS, "label_token_ids", "vLLM's bound of logprob_token_ids")
        for i, token in enumerate(ids):
            if not 0 <= token < vocab:
                raise ValidationError(f"label_token_ids[{i}] = {quoted(token)} is out of vocabulary range "
                                      f"[0, {vocab})", param="label_token_ids", value=token)
        if not ids:
            raise ValidationError("label_token_ids must contain at least one token ID", param="label_token_ids",
                                  value=ids)
        return list(dict.fromkeys(ids))

    def _check_fields(self, req: GenerativeScoringRequest) -> None:
        """items (1 to --max-prompts), priority, cache_salt and request_id (400 naming the field); each item's
        text, with the query's, within the prompt byte cap; token ids within the vocabulary and, query and item
        together, within max_model_len (all before anything is tokenized)."""
        if not req.items:
            raise ValidationError("items must contain at least one item", param="items", value=req.items)
        check_count(req.items, self.limits.max_prompts, "items", "--max-prompts")
        check_request_fields(req.priority, req.cache_salt, req.request_id)
        self._check_ids(req.query, "query")
        if isinstance(req.query, str):
            self.check_prompt_size(req.query, "query")
        for i, item in enumerate(req.items):
            self._check_ids(item, f"items[{i}]")
            if isinstance(item, str):
                self.check_prompt_size([req.query, item], f"items[{i}]")  # (the prompt is both)
            elif isinstance(req.query, list) and len(req.query) + len(item) >= self.max_model_len:
                self._too_long(len(req.query) + len(item), i)

    def _check_ids(self, value: str | list[int], param: str) -> None:
        """Token ids within the vocabulary and, alone, within max_model_len (400 naming ``param``)."""
        if isinstance(value, str):
            return
        vocab = self.engine.processor.vocab_size
        bad = next((t for t in value if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValidationError(f"{param} contains token id {quoted(bad)}, out of vocabulary range [0, {vocab})",
                                  param=param, value=bad)
        if len(value) >= self.max_model_len:
            raise ValidationError(f"{param} is {len(value)} tokens; with the one position read after the prompt, "
                                  f"max_model_len ({self.max_model_len}) allows at most {self.max_model_len - 1}",
                                  param=param, value=len(value))

    def _too_long(self, tokens: int, index: int) -> None:
        most = self.max_model_len - 1
        raise ValidationError(f"the query and items[{index}] are {tokens} tokens together; with the one position "
                              f"read after them, max_model_len ({self.max_model_len}) allows at most {most}",
                              param=f"items[{index}]", value=tokens)

    # ------------------------------------------------------------------ prompts
    async def _prompts(self, req: GenerativeScoringRequest) -> list[PromptType]:
        """Each item's prompt as token ids: the query's and the item's (texts tokenized in the tokenizer thread,
        the query with ``add_special_tokens``, items without), with the request's cache_salt."""
        tokenizer = self.tokenizer

        def encode(text: str | list[int], special: bool) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=special)) if isinstance(text, str) else list(text)

        def build() -> list[list[int]]:
            query = encode(req.query, req.add_special_tokens)
            return [encode(item, False) + query if req.item_first else query + encode(item, False)
                    for item in req.items]

        prompts = await self.engine.in_tokenizer_thread(build)
        out: list[PromptType] = []
        for i, ids in enumerate(prompts):
            if not ids:
                raise ValidationError(f"the query and items[{i}] are empty together: there is no prompt to read "
                                      "the next position of", param=f"items[{i}]")
            if len(ids) >= self.max_model_len:
                self._too_long(len(ids), i)
            prompt: dict = {"prompt_token_ids": ids}
            if req.cache_salt is not None:
                prompt["cache_salt"] = req.cache_salt
            out.append(prompt)
        return out

    # ------------------------------------------------------------------ the read
    async def read_labels(self, request_id: str, prompts: list[PromptType], labels: list[int],
                          lora: LoRARequest | None, raw: Request | None, param: str = "prompts"
                          ) -> tuple[list[RequestOutput], list[list[float]]] | None:
        """Each prompt (tokenized, checked) run for one token, all queued at once as ``{request_id}-{i}``: the
        outputs, and per prompt the full-vocabulary log-probabilities of ``labels`` (distinct vocabulary ids, at
        most MAX_LOGPROB_TOKEN_IDS) at the position after it, in ``labels``' order. None if the client left.
        RequestFailedError (a 500) if an output lacks a label's log-probability (``param``: what the prompts are
        called in its message). The logprobs are of the raw logits (before penalties and temperature), so the
        token is picked greedily: the cheapest pick."""
        params = SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=labels, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        streams = await self.add_all(request_id, prompts, params, lora, raw)
        if streams is None:
            return None  # (gone while its request was prepared)
        outputs = await self.outputs(streams, raw)
        if outputs is None:
            return None
        read: list[list[float]] = []
        for i, out in enumerate(outputs):
            sample = out.outputs[0] if out.outputs else None
            entry = sample.logprobs[0] if sample is not None and sample.logprobs else None
            missing = [t for t in labels if entry is None or t not in entry]
            if missing:
                raise RequestFailedError(f"the engine returned no log-probability of label token {missing[0]} "
                                         f"for {param}[{i}]")
            assert entry is not None
            read.append([entry[t].logprob for t in labels])
        return outputs, read

