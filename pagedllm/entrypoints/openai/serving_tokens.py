"""vLLM's token-in/token-out API: POST /inference/v1/generate and POST /inference/v1/abort_requests
(`pagedllm serve --enable-scale-out`; `--tokens-only` also serves them, forces detokenize off and adds the
unauthenticated legacy POST /abort_requests, as vLLM's flag). Without either flag the routes answer 403, as vLLM's.

A request is one prompt of token ids with n samples, run through the same admission, limits and abort-on-disconnect
as /v1/completions; the reply is always gathered from DELTA outputs, so an aborted request (abort_requests, a
disconnect, the request timeout) stops at once, frees its KV blocks, and its choices end with finish_reason
"abort" and the tokens they had."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import APIRouter, FastAPI
from pydantic import ValidationError as PydanticValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.chat_stream import ChoiceDeltas
from pagedllm.entrypoints.openai.http_guard import UnicodeCheckedRoute
from pagedllm.entrypoints.openai.limits import (
    check_constraint,
    check_request_tokens,
    check_sampling_limits,
    check_tools,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    TopLogprob,
    UsageInfo,
)
from pagedllm.entrypoints.openai.protocol_tokens import (
    AbortRequestsRequest,
    GenerateChoice,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateRequest,
    GenerateResponse,
    GenerateStreamResponse,
    TokensSamplingParams,
)
from pagedllm.entrypoints.openai.serving import (
    SSE_DONE,
    OpenAIServing,
    RequestTimeoutError,
    StreamGroup,
    finite_logprob,
    merge_streams,
    prompt_logprobs_json,
    unless_disconnected,
)
from pagedllm.entrypoints.openai.serving_pooling import check_generates
from pagedllm.errors import ValidationError
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
LEGACY_ABORT_PATH = "/abort_requests"
"""vLLM's unauthenticated abort route, served only with --tokens-only."""
REQUEST_ID_PREFIX = "generate-tokens-"
"""A reply's request_id: this and the request's request_id (or X-Request-Id header), as vLLM names it."""
_ENGINE_PARAMS = {"prompt_token_ids": "token_ids", "prompt": "token_ids"}
"""The engine's names for the prompt -> this API's."""


@contextlib.contextmanager
def _named(prefix: str = "sampling_params.") -> Iterator[None]:
    """Re-raise a ValidationError with its param named as this API names it (sampling_params.<field>, token_ids)."""
    try:
        yield
    except ValidationError as e:
        param = e.param
        if param in _ENGINE_PARAMS:
            param = _ENGINE_PARAMS[param]
        elif param is not None and not param.startswith(prefix) and param not in ("request_id", "model"):
            param = prefix + param
        raise ValidationError(e.message, param=param, value=e.value) from None


class _Choice:
    """One sample's reply gathered from DELTA outputs."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob] | None] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, c: CompletionOutput) -> None:
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs or []
        self.text += c.text
        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


PARSE_CONTEXT_KEYS = {"tools", "tool_choice", "parallel_tool_calls", "include_reasoning", "return_tokens_as_token_ids",
                      "chat_template_kwargs", "history_tool_call_cnt"}
"""vLLM's ParseContext keys (what /v1/chat/completions/render answers): the last two are read by nothing here."""


@dataclass
class _Parsing:
    """A derender request's parsing: the chat route's tool mode and reasoning parser for its parse_context."""

    tools: Any
    reasoning: Any
    hide: bool
    """include_reasoning false: no reasoning (nor logprobs) in the message."""


class ServingTokens(OpenAIServing):
    """The generate and abort endpoints (state: the replies still running, by their request_id)."""

    tokens_only = False
    """--tokens-only: detokenize is forced off (text mode and stop strings refused)."""
    chat: OpenAIServingChat | None = None
    """The chat route, whose parsers (--reasoning-parser, --tool-call-parser) output_mode "derender" replies use
    with the request's parse_context (from /v1/chat/completions/render)."""

    @property
    def has_parser(self) -> bool:
        return self.chat is not None and (self.chat.reasoning_parser is not None or self.chat.tool_parser is not None)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.running: dict[str, asyncio.Event] = {}
        """request_id -> the event abort_requests sets."""

    async def generate(self, req: GenerateRequest, raw: Request) -> Response:
        check_generates(self.engine.config.model, GENERATE_PATH)
        model, lora = self.check_model(req.model)
        sp = req.sampling_params
        self._check(req)
        reasoning = await self._reasoning(req)
        parsing = self._parsing(req, reasoning)
        prompt_len = len(req.token_ids)
        params = self._params(sp, prompt_len)
        self._after_reasoning(req, params, reasoning)
        shown = None if sp.logprobs is None else (len(sp.logprob_token_ids) if sp.logprob_token_ids else sp.logprobs)
        with _named():
            check_request_tokens(self.limits, self.max_model_len, [params.max_tokens], sp.n, bool(req.stream), shown,
                                 [prompt_len], sp.prompt_logprobs, names=("max_tokens", "logprobs"))
        base = raw.headers.get("X-Request-Id") or req.request_id
        if len(base) > 1024:
            raise ValidationError("X-Request-Id is over 1024 characters", param="request_id")
        request_id = REQUEST_ID_PREFIX + base
        if request_id in self.running:
            raise ValidationError(f"request id {request_id!r} is already in use", param="request_id")
        prompt: dict = {"prompt_token_ids": list(req.token_ids)}
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        aborted = self.running[request_id] = asyncio.Event()
        try:
            with _named():
                streams = await self.add_all(request_id, [prompt], params, lora, raw)
        except BaseException:
            del self.running[request_id]
            raise
        if streams is None:
            del self.running[request_id]
            return Response(status_code=499)  # the client went away while its request was prepared
        if req.stream:
            return StreamingResponse(self.with_error_events(self._stream(req, request_id, streams, aborted, parsing)),
                                     media_type="text/event-stream")
        try:
            gathered = await unless_disconnected(self._gather(req, streams, aborted), raw)
        except RequestTimeoutError:
            self.on_refused("timeout")  # (the server's metrics, as the other endpoints count it)
            raise
        finally:
            self.running.pop(request_id, None)
        if gathered is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        prompt_logprobs, id_scores, choices, cached = gathered
        body = GenerateResponse(
            request_id=request_id, model=model, created=int(time.time()), output_mode=req.output_mode,
            usage=self.usage(prompt_len, sum(len(c.token_ids) for c in choices), cached),
            prompt_logprobs=prompt_logprobs_json(prompt_logprobs) if sp.prompt_logprobs is not None else None,
            prompt_token_ids=list(req.token_ids) if req.return_token_ids else None,
            prompt_token_id_logprobs=None if id_scores is None else _numpy_base64(id_scores),
            choices=[self._choice(req, c.index, c.token_ids, c.logprobs, c.text, c.finish_reason or "stop",
                                  c.stop_reason, parsing) for c in choices])
        return JSONResponse(body.model_dump(exclude={"choices": {"__all__": self._left_out(req)}}))

    def abort(self, request_ids: str | list[str]) -> None:
        """End the named replies now (unknown or finished ones: nothing to do, as vLLM)."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            event = self.running.get(request_id)
            if event is not None:
                event.set()

    # ------------------------------------------------------------------ checks and parameters
    def _check(self, req: GenerateRequest) -> None:
        sp = req.sampling_params
        if len(req.token_ids) > self.max_model_len:
            raise ValidationError(f"token_ids has {len(req.token_ids)} tokens, more than max_model_len "
                                  f"({self.max_model_len})", param="token_ids", value=len(req.token_ids))
        if self.tokens_only and sp.stop:
            raise ValidationError("stop strings are not supported on a --tokens-only server because detokenization "
                                  "is disabled; check them on the coordinator, or use stop_token_ids",
                                  param="sampling_params.stop")
        if self.tokens_only and req.output_mode != "tokens":
            raise ValidationError(f"output_mode={req.output_mode!r} requires a tokenizer, but this server does not "
                                  "detokenize (--tokens-only); use output_mode='tokens'", param="output_mode")
        if req.output_mode == "derender" and self.has_parser and req.parse_context is None:
            raise ValidationError("output_mode='derender' on a server with a tool or reasoning parser needs "
                                  "parse_context (as /v1/chat/completions/render answers it)", param="parse_context")
        with _named():
            check_sampling_limits(sp, self.limits, self.engine.config.scheduler.max_num_seqs)

    async def _reasoning(self, req: GenerateRequest) -> Any:
        """The server's reasoning parser for this request (parse_context's template variables, its prompt decoded in
        the tokenizer thread), where derender parsing or reasoning_ended false needs it; None otherwise."""
        parser = None if self.chat is None else self.chat.reasoning_parser
        derender = req.output_mode == "derender" and self.has_parser
        constrained_late = req.reasoning_ended is False and req.sampling_params.structured_outputs is not None
        if parser is None or not (derender or constrained_late):
            return None
        kwargs = (req.parse_context or {}).get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ValidationError("parse_context.chat_template_kwargs must be an object",
                                  param="parse_context.chat_template_kwargs")
        prompt = await self.engine.in_tokenizer_thread(self.chat.tokenizer.decode, list(req.token_ids))
        return parser.for_request(dict(kwargs), prompt)

    def _parsing(self, req: GenerateRequest, reasoning: Any) -> _Parsing | None:
        """How derender replies are parsed on a server with parsers: parse_context's tools, tool_choice and
        template variables, as the chat route reads them (400 naming parse_context.<field>)."""
        if req.output_mode != "derender" or not self.has_parser or self.chat is None:
            return None
        from pagedllm.entrypoints.openai.serving_chat import _ToolMode
        from pagedllm.entrypoints.openai.translate import chat_request

        context = dict(req.parse_context or {})
        unknown = sorted(set(context) - PARSE_CONTEXT_KEYS)
        if unknown:
            raise ValidationError(f"parse_context.{unknown[0]} is not supported", param=f"parse_context.{unknown[0]}")
        fields = {k: context[k] for k in ("tools", "tool_choice", "parallel_tool_calls", "include_reasoning",
                                          "chat_template_kwargs") if context.get(k) is not None}
        try:
            chat_req = chat_request({"messages": [{"role": "user", "content": ""}], **fields}, {})
            check_tools(chat_req.tools, self.limits)  # (the chat route's bounds on tools)
            tools = _ToolMode.of(chat_req, self.chat.tool_parser)
        except ValidationError as e:
            raise ValidationError(f"parse_context: {e.message}", param=f"parse_context.{e.param or ''}".rstrip("."),
                                  value=e.value) from None
        return _Parsing(tools, reasoning, hide=not chat_req.include_reasoning and reasoning is not None)

    def _after_reasoning(self, req: GenerateRequest, params: SamplingParams, reasoning: Any) -> None:
        """reasoning_ended false with structured outputs: the grammar holds only after the reasoning's end, as the
        chat route sets it (with the server's reasoning parser, for parse_context's template variables)."""
        if req.reasoning_ended is not False or params.structured_outputs is None:
            return
        if reasoning is None:
            raise ValidationError("reasoning_ended=false with structured outputs needs a server started with "
                                  "--reasoning-parser (nothing here knows where the reasoning ends)",
                                  param="reasoning_ended")
        if reasoning.reasons_first:
            self.chat.grammar_after_reasoning(params, reasoning)

    def _params(self, sp: TokensSamplingParams, prompt_len: int) -> SamplingParams:
        """Our SamplingParams (always DELTA: the reply is gathered here); an omitted max_tokens filled to the rest
        of the context, so that min_tokens is checked against it."""
        with _named():
            constraint = None
            if sp.structured_outputs is not None:
                try:
                    constraint = StructuredOutputsParams(**sp.structured_outputs)
                except TypeError as e:
                    raise ValidationError(f"structured_outputs: {e}", param="structured_outputs") from None
                check_constraint(constraint, self.limits, f"sampling_params.structured_outputs.{constraint.kind}")
            max_tokens = self.filled(sp.max_tokens, prompt_len)
            if max_tokens < 1:
                raise ValidationError(f"token_ids has {prompt_len} tokens, leaving no room to generate within "
                                      f"max_model_len ({self.max_model_len})", param="token_ids", value=prompt_len)
            return SamplingParams(
                n=sp.n, presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
                repetition_penalty=sp.repetition_penalty, temperature=sp.temperature, top_p=sp.top_p,
                top_k=sp.top_k, min_p=sp.min_p, seed=sp.seed, stop=sp.stop, stop_token_ids=sp.stop_token_ids,
                ignore_eos=sp.ignore_eos, max_tokens=max_tokens, min_tokens=sp.min_tokens, logprobs=sp.logprobs,
                prompt_logprobs=sp.prompt_logprobs, logprob_token_ids=sp.logprob_token_ids,
                prompt_logprob_token_ids=sp.prompt_logprob_token_ids, prompt_logprob_start=sp.prompt_logprob_start,
                include_stop_str_in_output=sp.include_stop_str_in_output,
                skip_special_tokens=sp.skip_special_tokens, logit_bias=sp.logit_bias,
                allowed_token_ids=sp.allowed_token_ids, bad_words=sp.bad_words, structured_outputs=constraint,
                stream_interval=self.interval_of(sp.stream_interval), output_kind=RequestOutputKind.DELTA)

    # ------------------------------------------------------------------ outputs
    async def _outputs(self, streams: StreamGroup, aborted: asyncio.Event) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes or abort_requests names it (then its streams are aborted:
        its blocks freed)."""
        source = merge_streams(streams)
        waiter = asyncio.ensure_future(aborted.wait())
        step: asyncio.Future | None = None
        try:
            while not waiter.done():
                step = asyncio.ensure_future(source.__anext__())
                await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    return  # aborted (the finally below stops the pending step)
                try:
                    _, out = step.result()
                except StopAsyncIteration:
                    return
                yield out
        finally:
            waiter.cancel()
            if step is not None and not step.done():  # (also when this is cancelled: a client went away)
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await step
            await source.aclose()
            for stream in streams:  # (aborted before the first step: the source never started to abort them)
                stream.abort()

    async def _gather(self, req: GenerateRequest, streams: StreamGroup, aborted: asyncio.Event
                      ) -> tuple[list | None, Any, list[_Choice], int]:
        """(the prompt's logprobs, prompt_logprob_token_ids' scores, the choices by index, the prompt's prefix-cache
        hits) of a whole request (aborted before its first output: no tokens)."""
        prompt_logprobs = id_scores = None
        choices = {i: _Choice(i) for i in range(req.sampling_params.n)}
        cached = 0
        async for out in self._outputs(streams, aborted):
            prompt_logprobs = prompt_logprobs if out.prompt_logprobs is None else out.prompt_logprobs
            id_scores = id_scores if out.prompt_token_id_logprobs is None else out.prompt_token_id_logprobs
            cached = max(cached, out.num_cached_tokens)
            for c in out.outputs:
                choices[c.index].add(c)
        for c in choices.values():
            if c.finish_reason is None:  # (aborted)
                c.finish_reason = "abort"
        return prompt_logprobs, id_scores, list(choices.values()), cached

    async def _stream(self, req: GenerateRequest, request_id: str, streams: StreamGroup,
                      aborted: asyncio.Event, parsing: _Parsing | None = None) -> AsyncIterator[str]:
        n = req.sampling_params.n
        deltas = None if parsing is None else {index: self._deltas(parsing) for index in range(n)}
        generated = [0] * n
        finished = [False] * n
        prompt_tokens, cached = len(req.token_ids), 0
        prompt_ids = list(req.token_ids) if req.return_token_ids else None  # (the first chunk's)
        role_sent = [False] * n  # derender: the first delta of each choice names the role
        options = req.stream_options
        try:
            async for out in self._outputs(streams, aborted):
                cached = max(cached, out.num_cached_tokens)
                for c in out.outputs:
                    generated[c.index] += len(c.token_ids)
                    finished[c.index] = c.finish_reason is not None
                    if not (c.token_ids or c.finish_reason or (req.output_mode != "tokens" and c.text)):
                        continue
                    choice = self._choice(req, c.index, c.token_ids, c.logprobs or [], c.text, c.finish_reason,
                                          c.stop_reason)
                    if deltas is not None and not self._parsed(choice, deltas[c.index], c, parsing):
                        continue
                    if choice.delta is not None and not role_sent[c.index]:
                        choice.delta.role, role_sent[c.index] = "assistant", True
                    usage = (self.usage(prompt_tokens, generated[c.index], cached)
                             if options is not None and options.every_chunk else None)
                    yield self._chunk(req, request_id, [choice], usage, prompt_ids)
                    prompt_ids = None
            for index in range(n):  # aborted: each unfinished choice says so, with no new tokens
                if not finished[index]:
                    choice = self._choice(req, index, [], [], "", "abort", None)
                    if deltas is not None:
                        self._parsed(choice, deltas[index], CompletionOutput(index, "", [], None, None, "abort"),
                                     parsing)
                    if choice.delta is not None and not role_sent[index]:
                        choice.delta.role = "assistant"
                    yield self._chunk(req, request_id, [choice], None, prompt_ids)
                    prompt_ids = None
            if options is not None and options.include_usage:
                usage = self.usage(prompt_tokens, sum(generated), cached)
                chunk = GenerateStreamResponse(request_id=request_id, usage=usage, output_mode=req.output_mode,
                                               choices=[])
                yield f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
            yield SSE_DONE
        finally:
            self.running.pop(request_id, None)

    def _deltas(self, parsing: _Parsing) -> ChoiceDeltas:
        """One choice's streamed derender deltas on a server with parsers: the chat route's (chat_stream.py)."""
        from pagedllm.entrypoints.openai.serving_chat import ChatRun

        run = ChatRun("", "", None, parsing.tools, 0, None, reasoning=parsing.reasoning, hide_reasoning=parsing.hide)
        return ChoiceDeltas(self.chat, run, hold_ids=False)

    @staticmethod
    def _parsed(choice: GenerateChoice, deltas: ChoiceDeltas, c: CompletionOutput, parsing: _Parsing) -> bool:
        """A streamed derender choice parsed as the chat route streams it: reasoning split from content, tool calls
        whole at the end (finish_reason "tool_calls" when it called one); False: nothing left to send
        (include_reasoning false and only reasoning in this chunk)."""
        parsed = deltas.next(c, ids=True)
        choice.delta, choice.finish_reason = parsed.delta, parsed.finish_reason
        if not parsing.hide:
            return True
        choice.delta.reasoning_content, choice.logprobs, choice.token_ids = None, None, None
        return bool(choice.delta.content or choice.delta.tool_calls or choice.finish_reason)

    def _chunk(self, req: GenerateRequest, request_id: str, choices: list[GenerateChoice], usage: UsageInfo | None,
               prompt_ids: list[int] | None) -> str:
        chunk = GenerateStreamResponse(request_id=request_id, usage=usage, prompt_token_ids=prompt_ids,
                                       output_mode=req.output_mode, choices=choices)
        exclude: dict = {"choices": {"__all__": self._left_out(req)}}
        if prompt_ids is None:
            exclude["prompt_token_ids"] = True
        return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"

    @staticmethod
    def _left_out(req: GenerateRequest) -> set[str]:
        """Choice keys absent from this output mode's JSON (tokens mode has no text, derender a message or, streamed,
        a delta in its place)."""
        kept = {"tokens": set(), "text": {"text"}, "derender": {"delta" if req.stream else "message"}}
        return {"text", "message", "delta"} - kept[req.output_mode]

    def _choice(self, req: GenerateRequest, index: int, token_ids: list[int], logprobs: list, text: str,
                finish_reason: str | None, stop_reason: int | str | None,
                parsing: _Parsing | None = None) -> GenerateChoice:
        sp = req.sampling_params
        lp: GenerateLogProbs | ChatLogprobs | None = None
        if sp.logprobs is not None:
            listed = sp.logprob_token_ids is not None or sp.logprobs == -1
            top_n = (1 << 30) if listed else max(sp.logprobs, 0)
            # derender lists chat's top_logprobs: the first `logprobs` candidates (vLLM's chat cut)
            cut = None if listed or req.output_mode != "derender" else max(sp.logprobs, 0)
            lp = (self._token_logprobs(token_ids, logprobs, top_n) if req.output_mode == "tokens" else
                  self._text_logprobs(token_ids, logprobs, top_n, cut))
        derender = req.output_mode == "derender"
        message = ChatResponseMessage(content=text) if derender and not req.stream else None
        if message is not None and parsing is not None and self.chat is not None:  # (the chat route's parsing)
            message, finish_reason = self.chat.message_of(text, finish_reason, parsing.tools, parsing.reasoning)
            if parsing.hide:  # (as the chat route: what would show the reasoning goes too)
                message.reasoning_content, lp, token_ids = None, None, None
        return GenerateChoice(index=index, finish_reason=finish_reason, stop_reason=stop_reason,
                              token_ids=None if token_ids is None else list(token_ids), logprobs=lp,
                              text=text if req.output_mode == "text" else None,
                              message=message,
                              delta=DeltaMessage(content=text or None) if derender and req.stream else None)

    def _candidates(self, token_id: int, entry: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
        """A position's candidates as vLLM lists them: the sampled token first, then the top ``top_n`` by rank."""
        rest = [(t, lp) for t, lp in self.top_entries(entry, top_n) if t != token_id]
        return [(token_id, entry[token_id]), *rest]

    def _token_logprobs(self, token_ids: list[int], logprobs: list, top_n: int) -> GenerateLogProbs:
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            if not entry or token_id not in entry:
                content.append(GenerateLogProbsContent(token_id=token_id, logprob=-9999.0))
                continue
            top = [GenerateLogProb(token_id=t, logprob=finite_logprob(lp.logprob), rank=lp.rank or None)
                   for t, lp in self._candidates(token_id, entry, top_n)]
            sampled = entry[token_id]
            content.append(GenerateLogProbsContent(token_id=token_id, logprob=finite_logprob(sampled.logprob),
                                                   rank=sampled.rank or None, top_logprobs=top))
        return GenerateLogProbs(content=content)

    def _text_logprobs(self, token_ids: list[int], logprobs: list, top_n: int, cut: int | None = None
                       ) -> ChatLogprobs:
        """Chat's logprobs shape (tokens as text with their bytes; "token_id:<id>" and no bytes with
        --return-tokens-as-token-ids, as vLLM's text mode); ``cut``: at most that many top_logprobs."""
        def named(t: int, lp: Logprob | None) -> tuple[str, list[int] | None]:
            if self.return_tokens_as_token_ids:
                return f"token_id:{t}", None
            text = lp.decoded_token if lp is not None and lp.decoded_token is not None else \
                self.tokenizer.decode([t])
            return text, list(text.encode("utf-8", errors="replace"))

        content = []
        for token_id, entry in zip(token_ids, logprobs):
            if not entry or token_id not in entry:
                token, data = named(token_id, None)
                content.append(ChatTokenLogprob(token=token, logprob=-9999.0, bytes=data))
                continue
            top = []
            for t, lp in self._candidates(token_id, entry, top_n)[:cut]:
                token, data = named(t, lp)
                top.append(TopLogprob(token=token, logprob=finite_logprob(lp.logprob), bytes=data))
            token, data = named(token_id, entry[token_id])
            content.append(ChatTokenLogprob(token=token, logprob=finite_logprob(entry[token_id].logprob), bytes=data,
                                            top_logprobs=top))
        return ChatLogprobs(content=content)



# ---------------------------------------------------------------------- routes
router = APIRouter(route_class=UnicodeCheckedRoute)
"""The API's routes (build_app includes them with --enable-scale-out or --tokens-only)."""


def _serving(raw: Request) -> ServingTokens:
    return raw.app.state.tokens


@router.post(GENERATE_PATH)
async def generate(req: GenerateRequest, raw: Request) -> Response:
    """vLLM's token-in/token-out generation: token ids in, token ids (and with output_mode "text", text) out."""
    return await _serving(raw).generate(req, raw)


async def abort_requests(raw: Request) -> Response:
    """End the named generate replies (200 whether or not they still run, as vLLM; 400 for a bad body). The body
    is read as JSON whatever its Content-Type (vLLM's legacy clients send none)."""
    try:
        body = AbortRequestsRequest.model_validate_json(await raw.body())
    except PydanticValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ())) or None
        raise ValidationError(f"{loc or 'body'}: {first.get('msg', 'invalid request')}", param=loc) from None
    _serving(raw).abort(body.request_ids)
    return Response(status_code=200)


router.add_api_route(ABORT_PATH, abort_requests, methods=["POST"])
legacy_router = APIRouter(route_class=UnicodeCheckedRoute)
legacy_router.add_api_route(LEGACY_ABORT_PATH, abort_requests, methods=["POST"])

DISABLED_MESSAGE = ("Scale-out endpoints are disabled. Restart the server with --enable-scale-out to enable them.")


async def _disabled() -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=DISABLED_MESSAGE, type="PermissionDeniedError", code="403"))
    return JSONResponse(body.model_dump(), status_code=403)


def attach_tokens(app: FastAPI, serving: ServingTokens, enable_scale_out: bool, tokens_only: bool) -> None:
    """Serve the API (``serving`` in app.state.tokens) when either flag is on, else answer its routes with 403
    naming the flag, as vLLM does; --tokens-only also serves the unauthenticated legacy /abort_requests."""
    app.state.tokens = serving
    serving.tokens_only = tokens_only
    serving.chat = app.state.chat  # (derender's parsing)
    if not (enable_scale_out or tokens_only):
        for path in (GENERATE_PATH, ABORT_PATH):
            app.add_api_route(path, _disabled, methods=["POST"], include_in_schema=False)
        return
    app.include_router(router)
    if tokens_only:
        app.include_router(legacy_router)


def _numpy_base64(array: Any) -> str:
    """An array as vLLM's generate answers one (``prompt_token_id_logprobs``): the base64 text of its ``np.save``
    bytes, which ``np.load`` reads back with its shape and dtype."""
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
