"""POST /v1/completions."""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.processor import PromptType
from pagedllm.engine.prompt_embeds import decode_prompt_embeds
from pagedllm.entrypoints.openai.limits import check_count, check_request_tokens, check_samples
from pagedllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving import (
    SSE_DONE,
    OpenAIServing,
    counted_logprobs,
    finite_logprob,
    merge_streams,
    prompt_logprobs_json,
    shown_logprobs,
    sse,
    token_label,
)
from pagedllm.errors import ValidationError
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import BeamSearchParams


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        self.force_usage(req)
        model, lora = self.check_model(req.model)
        self.check_limits(req)
        if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
            check_count(req.prompt, self.limits.max_prompts, "prompt", "--max-prompts")
        if req.suffix is not None:
            raise ValidationError("suffix is not supported", param="suffix", value=req.suffix)
        if req.best_of is not None and req.best_of != req.n:
            raise ValidationError("best_of other than n is not supported", param="best_of", value=req.best_of)
        self.check_prompt_size(req.prompt, "prompt")
        self.check_runnable(req)
        keep = self.kept_tokens(req.truncate_prompt_tokens)
        embedded = self._check_embeds(req)
        prompts = [] if req.prompt is None or req.prompt == "" else self.prompts_of(req.prompt)
        check_samples(len(embedded) + len(prompts), max(req.n or 1, req.best_of or 1), self.limits)
        # echo with logprobs scores the prompt too (lm-eval's log-likelihoods): its tokens' log-probabilities lead
        prompt_logprobs = req.prompt_logprobs if req.prompt_logprobs is not None or not req.echo else req.logprobs
        # echo with max_tokens 0: the prompt alone (scored); as vLLM, one token is generated and left out
        only_echo = req.echo and req.max_tokens == 0 and not req.use_beam_search
        params = self._beam_params(req) if req.use_beam_search else \
            self.sampling_params(req, 1 if only_echo else req.max_tokens, req.logprobs, req.stream, prompt_logprobs)
        echoes = [""] * len(embedded) + [self._prompt_text(p) if req.echo else "" for p in prompts]
        self._check_waiting(embedded + prompts)  # (a full queue sheds it before it is tokenized)
        prompts = await self.tokenized(prompts)
        if keep is not None:
            echoes = self.truncate(prompts, keep, req.truncation_side or "left", echoes if req.echo else None)
        # prompts given as embeddings first (their choices lead, as vLLM's), then the text and token-id ones
        prompts = await self._decoded_embeds(embedded) + prompts
        lengths = [p["prompt_embeds"].num_tokens if "prompt_embeds" in p else len(p["prompt_token_ids"])
                   for p in prompts]
        check_request_tokens(self.limits, self.max_model_len, [self.filled(params.max_tokens, n) for n in lengths],
                             req.n, req.stream,
                             None if req.use_beam_search else counted_logprobs(req, req.logprobs), lengths,
                             prompt_logprobs)
        request_id = self.reply_id("cmpl", raw, req.request_id)  # (the reply's; the engine's are made apart)
        streams = await self.add_all(random_id("cmpl"), prompts, params, lora, raw)
        if streams is None:
            return Response(status_code=499)  # the client went away while its request was prepared
        if req.stream:
            return StreamingResponse(self.with_error_events(self._stream(request_id, model, req, streams, echoes,
                                                                         only_echo)),
                                     media_type="text/event-stream")
        outputs = await self.outputs(streams, raw)
        if outputs is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        logprobs = None if req.use_beam_search else shown_logprobs(req, req.logprobs)
        as_ids = self.as_token_ids(req)
        choices = [self._choice(i * req.n + c.index, _without_generation(c) if only_echo else c, echoes[i], logprobs,
                                getattr(out, "prompt_logprobs", None) if req.prompt_logprobs is not None else None,
                                self._echo_logprobs(out, logprobs, as_ids) if req.echo else None,
                                out.prompt_token_ids if req.return_token_ids else None, as_ids)
                   for i, out in enumerate(outputs) for c in out.outputs]
        usage = self._usage(outputs)
        metrics = None if req.use_beam_search or len(outputs) != 1 else \
            self.request_metrics(outputs[0], req.n, usage.completion_tokens)
        return JSONResponse(CompletionResponse(id=request_id, model=model, choices=choices, usage=usage,
                                               metrics=metrics).model_dump())

    def _check_embeds(self, req: CompletionRequest) -> list[str]:
        """The request's prompt_embeds as a list (none: []), refused (400 naming the field) when the server was not
        started with --enable-prompt-embeds or a field that needs the prompt's tokens or text comes with them."""
        given = req.prompt_embeds
        embedded = [given] if isinstance(given, str) else list(given or [])
        if not embedded:
            return []
        if self.engine.processor.embeds_hidden_size is None:
            raise ValidationError("prompt_embeds needs a server started with --enable-prompt-embeds",
                                  param="prompt_embeds")
        check_count(embedded, self.limits.max_prompts, "prompt_embeds", "--max-prompts")
        for name, value, unset in (("prompt_logprobs", req.prompt_logprobs, None), ("echo", req.echo, False),
                                   ("use_beam_search", req.use_beam_search, False),
                                   ("truncate_prompt_tokens", req.truncate_prompt_tokens, None)):
            if value != unset:
                raise ValidationError(f"{name} is not compatible with prompt_embeds (the prompt has no tokens or "
                                      "text of its own)", param=name, value=value)
        return embedded

    async def _decoded_embeds(self, embedded: list[str]) -> list[dict]:
        """Each base64 prompt_embeds entry decoded and checked against the model (in the tokenizer thread: a
        payload can be megabytes), as {"prompt_embeds": PromptEmbeds}."""
        if not embedded:
            return []
        processor = self.engine.processor

        def decode() -> list[dict]:
            return [{"prompt_embeds": processor.prompt_embeds(decode_prompt_embeds(e, self.max_model_len,
                                                                                   processor.embeds_hidden_size))}
                    for e in embedded]

        return await self.engine.in_tokenizer_thread(decode)

    def _beam_params(self, req: CompletionRequest) -> BeamSearchParams:
        """Beam search: n beams, greedy, no streaming (the best beams are known only at the end)."""
        for name, bad in (("stream", req.stream), ("logprobs", req.logprobs is not None),
                          ("temperature", req.temperature not in (None, 0, 0.0))):
            if bad:
                raise ValidationError(f"{name} cannot be used with use_beam_search", param=name)
        # beam search scores the model's own log-probabilities: fields that edit them or stop early would be ignored
        defaults = CompletionRequest.model_fields
        for name in ("logit_bias", "allowed_token_ids", "bad_words", "prompt_logprobs", "structured_outputs",
                     "response_format", "stop", "stop_token_ids",
                     "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "min_tokens", "seed"):
            if getattr(req, name) not in (defaults[name].default, None, [], {}):
                raise ValidationError(f"{name} cannot be used with use_beam_search", param=name)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                length_penalty=req.length_penalty)

    def kept_tokens(self, tokens: int | None) -> int | None:
        """truncate_prompt_tokens as the count each prompt keeps (None: no truncation): 1 to max_model_len, or -1
        for max_model_len - 1 (as vLLM: a token of the context is left for the reply)."""
        if tokens is None:
            return None
        if tokens > self.max_model_len:
            raise ValidationError(f"truncate_prompt_tokens={tokens} cannot be greater than max_model_len "
                                  f"({self.max_model_len}): ask for a smaller truncation size",
                                  param="truncate_prompt_tokens", value=tokens)
        if tokens == -1:
            return max(self.max_model_len - 1, 1)
        if tokens < 1:
            raise ValidationError.bad_value("truncate_prompt_tokens", tokens,
                                            "a positive integer, or -1 for max_model_len - 1")
        return tokens

    def truncate(self, prompts: list[dict], keep: int, side: str, echoes: list[str] | None) -> list[str]:
        """Cut each tokenized prompt to its ``keep`` last ("left") or first ("right") tokens, in place; the echoed
        texts (``echoes``, None without echo) of the cut ones become their kept tokens' text."""
        shown = list(echoes) if echoes is not None else [""] * len(prompts)
        for i, p in enumerate(prompts):
            ids = p["prompt_token_ids"]
            if len(ids) <= keep:
                continue
            p["prompt_token_ids"] = ids[-keep:] if side == "left" else ids[:keep]
            p["prompt"] = None  # (the text was the whole prompt's)
            if echoes is not None:
                shown[i] = self.tokenizer.decode(p["prompt_token_ids"])
        return shown

    @staticmethod
    def prompts_of(prompt: str | list) -> list[PromptType]:
        """A request's prompt field as engine prompts: texts, or {"prompt_token_ids": ids}."""
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValidationError("prompt must not be empty", param="prompt", value=prompt)
        if isinstance(prompt[0], int):
            return [{"prompt_token_ids": prompt}]
        if isinstance(prompt[0], str):
            return list(prompt)
        return [{"prompt_token_ids": ids} for ids in prompt]

    def _prompt_text(self, prompt: PromptType) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt["prompt_token_ids"])

    def _choice(self, index: int, c: CompletionOutput, echo: str, logprobs: int | None,
                prompt_logprobs: list | None = None, echoed: CompletionLogprobs | None = None,
                prompt_ids: list[int] | None = None, as_ids: bool = False) -> CompletionChoice:
        """One finished choice; ``prompt_ids`` (return_token_ids): its prompt's and its own token ids added;
        ``as_ids``: its logprobs name tokens by id."""
        lp = None if c.logprobs is None else self.logprobs_of(c, self.end_of(echoed, len(echo)), logprobs or 0, echoed,
                                                            as_ids)
        return CompletionChoice(index=index, text=echo + c.text, logprobs=lp, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason, prompt_logprobs=prompt_logprobs_json(prompt_logprobs),
                                prompt_token_ids=None if prompt_ids is None else list(prompt_ids),
                                token_ids=None if prompt_ids is None else list(c.token_ids))

    def logprobs_of(self, c: CompletionOutput, offset: int, top_n: int,
                  before: CompletionLogprobs | None = None, as_ids: bool = False) -> CompletionLogprobs:
        """OpenAI's logprobs of the generated tokens, after ``before`` (the echoed prompt's) when given."""
        out = CompletionLogprobs() if before is None else before.model_copy(deep=True)
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            offset = self._append(out, token_id, entry, offset, top_n, as_ids)
        return out

    def _append(self, out: CompletionLogprobs, token_id: int, entry: dict | None, offset: int, top_n: int,
                as_ids: bool = False) -> int:
        """One token into ``out`` (``entry`` None: the prompt's first token, which nothing predicts); the next
        token's text offset (counted in the text, also when ``as_ids`` names the tokens "token_id:<id>")."""
        if entry is None:
            text = self.tokenizer.decode([token_id])
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            sampled = entry[token_id]
            text = sampled.decoded_token or ""
            out.token_logprobs.append(finite_logprob(sampled.logprob))
            top = {token_label(token_id, text, as_ids): finite_logprob(sampled.logprob)}  # the token first, as vLLM
            top.update((token_label(t, lp.decoded_token, as_ids), finite_logprob(lp.logprob))
                       for t, lp in self.top_entries(entry, top_n))
            out.top_logprobs.append(top)
        out.tokens.append(token_label(token_id, text, as_ids))
        out.text_offset.append(offset)
        out._end = offset + len(text)
        return out._end

    def _echo_logprobs(self, out: RequestOutput, top_n: int | None, as_ids: bool = False) -> CompletionLogprobs | None:
        """With echo and logprobs: the prompt's tokens as OpenAI and vLLM list them (the first with a null
        log-probability), offsets counted from the start of the echoed text."""
        scored = getattr(out, "prompt_logprobs", None)
        if top_n is None or scored is None:
            return None
        echoed, offset = CompletionLogprobs(), 0
        for token_id, entry in zip(out.prompt_token_ids, scored):
            offset = self._append(echoed, token_id, entry, offset, top_n, as_ids)
        return echoed

    @staticmethod
    def end_of(echoed: CompletionLogprobs | None, default: int) -> int:
        """The text offset after the echoed prompt's tokens (``default`` without them)."""
        return default if echoed is None or not echoed.tokens else echoed._end

    def _usage(self, outputs: list[RequestOutput]) -> UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        return self.usage(prompt, completion, sum(max(o.num_cached_tokens, 0) for o in outputs))

    async def _stream(self, request_id: str, model: str, req: CompletionRequest, streams: list,
                      echoes: list[str], only_echo: bool = False) -> AsyncIterator[str]:
        prompt_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}  # per prompt, its prefix-cache hits
        completion_tokens = 0
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        generated: dict[int, int] = {}  # per choice, its tokens so far (continuous usage)
        every_chunk = req.stream_options is not None and req.stream_options.every_chunk
        prompt_lps: dict[int, CompletionLogprobs | None] = {}  # per prompt: its echoed tokens' logprobs
        as_ids = self.as_token_ids(req)
        last = None  # the last output (its timing: --enable-per-request-metrics, one prompt)
        async for i, out in merge_streams(streams):
            last = out
            prompt_tokens[i] = len(out.prompt_token_ids)
            cached_tokens[i] = max(cached_tokens.get(i, 0), out.num_cached_tokens)
            if req.echo and i not in prompt_lps:  # (they come with a prompt's first output)
                prompt_lps[i] = self._echo_logprobs(out, req.logprobs, as_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)  # (echo without generation too: as vLLM, its one token)
                generated[i * req.n + c.index] = generated.get(i * req.n + c.index, 0) + len(c.token_ids)
                c = _without_generation(c) if only_echo else c
                index = i * req.n + c.index
                first = index not in echoed
                echo = echoes[i] if first else ""
                before = prompt_lps.get(i) if first else None
                echoed.add(index)
                lp = None
                if c.logprobs is not None:
                    start = offsets.get(index, self.end_of(before, len(echo)))
                    lp = self.logprobs_of(c, start, shown_logprobs(req, req.logprobs) or 0, before, as_ids)
                    offsets[index] = self.end_of(lp, start)
                choice = CompletionChoice(index=index, text=echo + c.text, logprobs=lp, finish_reason=c.finish_reason,
                                          stop_reason=c.stop_reason)
                if req.return_token_ids:  # the prompt's ids with a choice's first chunk, then each chunk's own
                    choice.prompt_token_ids = list(out.prompt_token_ids) if first else None
                    choice.token_ids = list(c.token_ids)
                usage = self.usage(prompt_tokens[i], generated[index], cached_tokens[i]) if every_chunk else None
                yield sse(CompletionResponse(id=request_id, model=model, choices=[choice], usage=usage))
        if req.stream_options and req.stream_options.include_usage:
            usage = self.usage(sum(prompt_tokens.values()), completion_tokens, sum(cached_tokens.values()))
            metrics = None if req.use_beam_search or len(streams) != 1 else \
                self.request_metrics(last, req.n, completion_tokens)
            yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage, metrics=metrics))
        yield SSE_DONE


def _without_generation(c: CompletionOutput) -> CompletionOutput:
    """An output with its generated text, tokens and log-probabilities left out (echo with max_tokens 0); its
    finish reason stays."""
    return dataclasses.replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [])
