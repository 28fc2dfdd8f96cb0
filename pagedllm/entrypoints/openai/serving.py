"""Request handling shared by the completion and chat endpoints: validation, sampling params,
fan-out of several prompts, streaming and abort on disconnect."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from pagedllm.engine.async_llm import AsyncLLM, RequestStream
from pagedllm.engine.core_client import EngineDeadError
from pagedllm.engine.processor import PromptType
from pagedllm.entrypoints.openai.limits import (
    BYTES_PER_TOKEN_CAP,
    ServingLimits,
    check_constraint,
    check_sampling_limits,
)
from pagedllm.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    PerRequestMetrics,
    PromptLogprob,
    PromptTokensDetails,
    SamplingFields,
    StreamOptions,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.errors import QUOTE_CHARS, ValidationError, quoted
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import Logprob, RequestMetrics, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

T = TypeVar("T")

MIN_LOGPROB = -9999.0
"""The log-probability reported for a token that cannot be chosen (masked by structured outputs, allowed_token_ids
or bad_words: -inf, which JSON cannot carry), as vLLM reports it."""


EVERY_LISTED = 1 << 30
"""The top-N shown of a request with logprob_token_ids: every token its positions list (those ids and the sampled
token, each with its own rank), as vLLM lists them."""


def shown_logprobs(req: SamplingFields, top_n: int | None) -> int | None:
    """How many alternatives each reported position shows: ``top_n``, or EVERY_LISTED with logprob_token_ids or
    for -1 (vLLM's "every token": the engine lists the whole vocabulary)."""
    listed = top_n is not None and (req.logprob_token_ids is not None or top_n == -1)
    return EVERY_LISTED if listed else top_n


def counted_logprobs(req: SamplingFields, top_n: int | None) -> int | None:
    """The alternatives per token that the request's size check counts: its logprob_token_ids' number, else
    ``top_n``."""
    return len(req.logprob_token_ids) if top_n is not None and req.logprob_token_ids is not None else top_n


def finite_logprob(value: float) -> float:
    """``value`` at least MIN_LOGPROB (NaN too), so that every reported log-probability is a finite JSON number."""
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


class OverloadedError(Exception):
    """The waiting queue is full: the request is refused with 503 and Retry-After, nothing else is touched."""

    retry_after = 1
    """Seconds the client is asked to wait (a step or a few: the queue drains at every step)."""


class RequestTimeoutError(Exception):
    """The request outlived --request-timeout: it was aborted (its blocks freed)."""


class RequestFailedError(Exception):
    """Handling this request failed inside the engine (its grammar, seed, beam step, detokenizing): it alone
    ends, with a 500 in OpenAI's shape (or an error event on a stream); the engine goes on."""


class StreamGroup(list):
    """The streams of one request's prompts, and the time by which the request must finish (its
    --request-timeout counted from before its preparation)."""

    def __init__(self, streams: list[RequestStream], deadline: float | None, timeout: float | None) -> None:
        super().__init__(streams)
        self.deadline = deadline
        """The event loop's time at which the request is aborted (None: no limit)."""
        self.timeout = timeout


def text_bytes(value: Any) -> int:
    """UTF-8 bytes of every string in a request field (strings, lists, dicts, pydantic models)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, BaseModel):
        value = dict(value)
    if isinstance(value, dict):  # keys too: a tool call's dict reaches the chat template whole
        return sum(text_bytes(k) + text_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(text_bytes(v) for v in value)
    return 0


@dataclasses.dataclass
class Admission:
    """Prompts past the --max-waiting-requests check whose adds have not begun (the engine counts a prompt as
    waiting once its add begins): counted in the check too, so that requests arriving together cannot all pass
    it before any of them is queued. One per server, shared by its endpoints."""

    submitting: int = 0


class OpenAIServing:
    """What both endpoints need from the engine."""

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels,
                 limits: ServingLimits | None = None, admission: Admission | None = None) -> None:
        self.admission = admission or Admission()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.model.max_model_len
        self.models = models
        self.limits = limits or ServingLimits()
        self.on_refused: Callable[[str], None] = lambda reason: None
        """Told of every request shed here: "overloaded" or "timeout" (the server's metrics)."""
        self.prompt_tokens_details = False
        """--enable-prompt-tokens-details: usage blocks carry prompt_tokens_details.cached_tokens."""
        self.return_tokens_as_token_ids = False
        """--return-tokens-as-token-ids: logprobs name tokens "token_id:<id>" unless a request says otherwise."""
        self.stream_interval = 1
        """--stream-interval: the fewest tokens a streamed chunk gathers (a request may ask for more)."""
        self.force_include_usage = False
        """--enable-force-include-usage: every streamed reply carries usage (see force_usage)."""
        self.per_request_metrics = False
        """--enable-per-request-metrics: a chat or completions reply of one choice carries its timing
        (request_metrics)."""

    def request_metrics(self, out: RequestOutput | None, n: int, generated: int) -> PerRequestMetrics | None:
        """vLLM's per-request timing of a finished request that generated ``generated`` tokens; None unless the
        server was started with --enable-per-request-metrics, and for n > 1 (one request's timing is not each
        choice's)."""
        if not self.per_request_metrics or n != 1 or out is None:
            return None
        return timing_metrics(out.metrics, generated)

    def force_usage(self, req: SamplingFields) -> None:
        """--enable-force-include-usage (vLLM's flag): a streamed request's stream_options become include_usage
        and continuous_usage_stats, whatever it sent: each chunk carries the usage so far, and a last chunk the
        whole. A request without stream is left as it is (its reply always has usage)."""
        if self.force_include_usage and req.stream:
            req.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)

    def as_token_ids(self, req: SamplingFields) -> bool:
        """Whether this request's logprobs name tokens by id (its return_tokens_as_token_ids, else the server's)."""
        asked = req.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if asked is None else asked

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        """``usage_info``, with prompt_tokens_details where the server was started to report them."""
        usage = usage_info(prompt_tokens, completion_tokens, cached_tokens)
        if self.prompt_tokens_details:
            usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached_tokens)
        return usage

    def check_limits(self, req: SamplingFields) -> None:
        """The request's sizes against this server's limits (400 naming the field), before anything else; and, as
        vLLM, stream_options only with stream (an empty or null one passes, as there), prompt_logprobs only without
        it."""
        check_sampling_limits(req, self.limits, self.engine.config.scheduler.max_num_seqs)
        if req.stream_options is not None and req.stream_options.model_fields_set and not req.stream:
            raise ValidationError("stream_options can only be given with stream=true", param="stream_options")
        if req.logprob_token_ids is not None:
            logprobs = getattr(req, "logprobs", None)  # (chat: true or false; completions: a count or null)
            if logprobs is None or logprobs is False:
                raise ValidationError("logprob_token_ids needs logprobs set (true on chat, a number on completions)",
                                      param="logprob_token_ids")
            if getattr(req, "use_beam_search", False):
                raise ValidationError("logprob_token_ids is not supported with beam search",
                                      param="logprob_token_ids")
        prompt_logprobs = getattr(req, "prompt_logprobs", None)  # (completions and chat)
        if prompt_logprobs is not None and req.stream:
            raise ValidationError("prompt_logprobs cannot be streamed", param="prompt_logprobs", value=prompt_logprobs)

    def constraint(self, req: SamplingFields) -> StructuredOutputsParams | None:
        """The request's structured-output constraint, within this server's limits (before it is compiled)."""
        spec = structured_outputs(req)
        if spec is not None:
            check_constraint(spec, self.limits, constraint_param(req, spec))
        return spec

    def check_prompt_size(self, value: Any, param: str, cap: int | None = None) -> None:
        """ValidationError (400) when the prompt text of ``value`` is over the byte cap (``cap``, default the
        server's: --max-prompt-bytes, else BYTES_PER_TOKEN_CAP per token of max_model_len), before any
        tokenizing."""
        cap = cap or self.limits.max_prompt_bytes or BYTES_PER_TOKEN_CAP * self.max_model_len
        size = text_bytes(value)
        if size > cap:
            raise ValidationError(f"{param} is {size} bytes of text, over this server's cap of {cap} bytes "
                                  f"(max_model_len is {self.max_model_len} tokens)", param=param)

    async def tokenized(self, prompts: list[PromptType]) -> list[dict[str, Any]]:
        """Each prompt as {"prompt": text or None, "prompt_token_ids": ids}, tokenized in the engine's tokenizer
        thread (one hop for them all): never on the event loop, and their lengths known before anything is
        queued (ValidationError naming a bad one, as the engine would)."""
        processor = self.engine.processor

        def tokenize() -> list[dict[str, Any]]:
            return [dict(zip(("prompt", "prompt_token_ids"), processor.tokenize_prompt(p))) for p in prompts]

        return await self.engine.in_tokenizer_thread(tokenize)

    def filled(self, max_tokens: int | None, prompt_tokens: int) -> int:
        """A request's max_tokens, an omitted one filled to the rest of the context (as the engine fills it)."""
        return max_tokens if max_tokens is not None else max(self.max_model_len - prompt_tokens, 0)

    async def outputs(self, streams: StreamGroup, raw: Request | None) -> list[RequestOutput] | None:
        """Every stream's final output (None if the client disconnected first; ``raw`` None: a request no client
        waits on, a background response), within the request timeout."""
        try:
            work = final_outputs(streams)
            return await (work if raw is None else unless_disconnected(work, raw))
        except RequestTimeoutError:
            self.on_refused("timeout")
            raise

    async def with_error_events(self, events: AsyncIterator[str],
                                error_events: Callable[[ErrorInfo], list[str]] | None = None) -> AsyncIterator[str]:
        """A stream's events; a timeout, a failed request or a dead engine after the response started becomes
        ``error_events(error)`` (default: an event in OpenAI's error shape, then [DONE]; the status line was
        already sent)."""
        try:
            async for event in events:
                yield event
        except LATE_FAILURES as e:
            if isinstance(e, RequestTimeoutError):
                self.on_refused("timeout")
            for event in (error_events or _openai_error_events)(late_failure(e)):
                yield event

    def check_model(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """(the model name to answer with, the LoRA adapter it names or None); a name we do not serve raises
        ModelNotFoundError."""
        return self.models.resolve(model)

    def sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        stream: bool, prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams from the request's fields (SamplingParams names any out-of-range field)."""
        if req.watermarking and self.engine.config.watermark is None:
            raise ValidationError("watermarking: this server watermarks nothing (start it with --watermark-config)",
                                  param="watermarking", value=True)
        return SamplingParams(
            n=req.n, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed, stop=req.stop,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, max_tokens=max_tokens,
            min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens, logit_bias=req.logit_bias,
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words, logprob_token_ids=req.logprob_token_ids,
            structured_outputs=self.constraint(req), speculate=req.speculate,
            watermarking=req.watermarking is not False, stream_interval=self.interval_of(req.stream_interval),
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)

    @staticmethod
    def check_runnable(req: SamplingFields) -> None:
        """What only a render route takes, refused where a request runs (400 naming it)."""
        if req.return_token_offsets:
            raise ValidationError("return_token_offsets is for the render routes (/v1/chat/completions/render, "
                                  "/v1/completions/render)", param="return_token_offsets", value=True)

    @staticmethod
    def reply_id(prefix: str, raw: Request | None, asked: str | None) -> str:
        """A reply's id, as vLLM makes it: "<prefix>-" and the X-Request-Id header's id, else the request's own
        request_id, else a random one (the engine's request ids are made apart: see SamplingFields.request_id)."""
        base = (None if raw is None else raw.headers.get("X-Request-Id")) or asked
        if base is None:
            return random_id(prefix)
        if len(base) > 1024:
            raise ValidationError("X-Request-Id is over 1024 characters", param="request_id")
        return f"{prefix}-{base}"

    def interval_of(self, asked: int | None) -> int:
        """A request's stream_interval, raised to the server's --stream-interval (vLLM's clamp)."""
        return max(asked or 1, self.stream_interval)

    async def add_all(self, request_id: str, prompts: list[PromptType], params: SamplingParams | BeamSearchParams,
                      lora_request: LoRARequest | None = None, raw: Request | None = None) -> StreamGroup | None:
        """Queue every prompt at once (one round trip to the engine, not one per prompt); if one is refused,
        withdraw the others and raise its ValidationError. Over the waiting limit, nothing is queued:
        OverloadedError. The request timeout covers the preparation (a grammar compiling); a client that
        disconnects meanwhile withdraws everything (None)."""
        timeout = self.limits.request_timeout
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        self._check_waiting(prompts)
        self.admission.submitting += len(prompts)
        work = self._submit(request_id, prompts, params, lora_request)
        try:
            streams = await asyncio.wait_for(work, timeout) if raw is None else \
                await unless_disconnected(asyncio.wait_for(work, timeout), raw)
        except asyncio.TimeoutError:  # TimeoutError's alias from 3.11
            self.on_refused("timeout")
            raise RequestTimeoutError(f"the request took over {timeout:g} s (the server's request timeout) "
                                      "and was aborted") from None
        return None if streams is None else StreamGroup(streams, deadline, timeout)

    async def _submit(self, request_id: str, prompts: list[PromptType], params: SamplingParams | BeamSearchParams,
                      lora_request: LoRARequest | None) -> list[RequestStream]:
        """Every prompt added concurrently; on any failure (or cancellation) the accepted ones are aborted."""
        begun = 0

        async def add(i: int, prompt: PromptType) -> RequestStream:
            nonlocal begun
            begun += 1
            self.admission.submitting -= 1  # the engine counts it from its add's first step
            return await self.engine.add_request(f"{request_id}-{i}", prompt, params, lora_request=lora_request)

        adds = [asyncio.ensure_future(add(i, prompt)) for i, prompt in enumerate(prompts)]
        completed = False
        try:
            await asyncio.wait(adds)
            completed = True
        finally:
            self.admission.submitting -= len(prompts) - begun  # adds cancelled before they began
            for add in adds:
                if not add.done():
                    add.cancel()  # cancelled while waiting: its own handler withdraws it from the engine
            failures = [a.exception() for a in adds if a.done() and not a.cancelled() and a.exception()]
            # (a task just cancelled above is not cancelled() yet: an interrupted wait itself says so; the
            # accepted ones were left running when a client left while others still tokenized)
            if failures or not completed or any(a.cancelled() for a in adds):
                for add in adds:
                    if add.done() and not add.cancelled() and add.exception() is None:
                        add.result().abort()
        if failures:
            raise failures[0]
        return [add.result() for add in adds]

    def _check_waiting(self, prompts: list[PromptType]) -> None:
        """The --max-waiting-requests checks (400 for a request that could never fit, 503 when full)."""
        limit = self.limits.max_waiting_requests
        if limit is not None and len(prompts) > limit:  # could never be admitted: not a matter of waiting
            raise ValidationError(f"{len(prompts)} prompts in one request: this server queues at most {limit} "
                                  "(--max-waiting-requests)", param="prompt")
        waiting = self.engine.num_waiting + self.admission.submitting
        if limit is not None and waiting + len(prompts) > limit:
            self.on_refused("overloaded")
            raise OverloadedError(f"the server is at its limit of {limit} waiting requests "
                                  f"({waiting} waiting); retry in a moment")

    @staticmethod
    def top_entries(entry: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
        """The top-N (by rank) of one position's logprobs (EVERY_LISTED: all of them, the logprob_token_ids')."""
        return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n),
                      key=lambda item: item[1].rank)[:top_n]


LATE_FAILURES = (RequestTimeoutError, EngineDeadError, RequestFailedError)
"""How a request fails once its answer has begun (its stream's status line sent, a background response queued)."""


def late_failure(e: Exception) -> ErrorInfo:
    """One of LATE_FAILURES as the error its stream ends in (or a background response records)."""
    timeout = isinstance(e, RequestTimeoutError)
    code = "request_timeout" if timeout else "request_failed" if isinstance(e, RequestFailedError) else "engine_dead"
    return ErrorInfo(message=str(e), type="timeout_error" if timeout else "server_error", code=code)


async def merge_streams(streams: StreamGroup) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; closing this aborts them all, and so do the
    request's deadline passing before the last output (RequestTimeoutError) and a failed request
    (RequestFailedError)."""
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    deadline, timeout = streams.deadline, streams.timeout

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as e:  # EngineDeadError: hand it to the consumer
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            if deadline is None:
                index, item = await queue.get()
            else:
                try:
                    index, item = await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:  # TimeoutError's alias from 3.11; a class of its own before
                    raise RequestTimeoutError(f"the request took over {timeout:g} s (the server's request "
                                              "timeout) and was aborted") from None
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            elif item.error is not None:
                raise RequestFailedError(f"the request failed in the engine: {item.error}")
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


async def final_outputs(streams: StreamGroup) -> list[RequestOutput]:
    """The finished output of every stream, in prompt order (RequestTimeoutError past the deadline)."""
    results: list[RequestOutput | None] = [None] * len(streams)
    async for index, out in merge_streams(streams):
        if out.finished:
            results[index] = out
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


async def unless_disconnected(work: Awaitable[T], raw: Request) -> T | None:
    """Run ``work``; if the client disconnects first, cancel it (its streams abort) and return None."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def timing_metrics(metrics: RequestMetrics | None, generated: int) -> PerRequestMetrics:
    """vLLM's PerRequestMetrics of a request's timestamps (a figure whose timestamps are missing stays None)."""
    if metrics is None:
        return PerRequestMetrics()
    scheduled, first, last = metrics.first_scheduled_time, metrics.first_token_time, metrics.last_token_time
    out = PerRequestMetrics()
    if scheduled is not None:
        out.queue_time_ms = max(scheduled - metrics.arrival_time, 0.0) * 1000
    if scheduled is not None and first is not None:
        out.time_to_first_token_ms = max(first - scheduled, 0.0) * 1000
    if first is not None and last is not None:
        out.generation_time_ms = (last - first) * 1000
        if generated > 1:
            out.mean_itl_ms = (last - first) / (generated - 1) * 1000
    if scheduled is not None and last is not None and last > scheduled:
        out.tokens_per_second = generated / (last - scheduled)
    return out


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
    """OpenAI's usage block (``cached_tokens``: the prompt's prefix-cache hits, kept out of chat's JSON)."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens, cached_tokens=cached_tokens)


def token_label(token_id: int, decoded: str | None, as_ids: bool) -> str:
    """How a logprobs entry names its token: its text, or (return_tokens_as_token_ids, as vLLM) "token_id:<id>",
    which names even a token whose bytes are not whole UTF-8 characters."""
    return f"token_id:{token_id}" if as_ids else decoded or ""


def prompt_logprobs_json(scored: list[dict[int, Logprob] | None] | None
                         ) -> list[dict[int, PromptLogprob] | None] | None:
    """A request's prompt_logprobs as vLLM returns them (completions' choices, chat's reply): per prompt position
    (None for the first, which nothing predicts), token id -> its log-probability, rank and text."""
    if scored is None:
        return None
    return [None if entry is None else {t: PromptLogprob(logprob=finite_logprob(e.logprob), rank=e.rank,
                                                         decoded_token=e.decoded_token) for t, e in entry.items()}
            for entry in scored]


def sse(payload: Any) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return f"data: {payload.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _openai_error_events(error: ErrorInfo) -> list[str]:
    """A failure on a chat or completion stream: the error in OpenAI's shape, then [DONE]."""
    return [sse(ErrorResponse(error=error)), SSE_DONE]


RESPONSE_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
"""The keys of each response_format type (OpenAI's); any other is refused, never silently ignored."""
JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
"""The keys of response_format.json_schema (OpenAI's; "strict" changes nothing: the schema is always enforced)."""


def _unknown_key(where: str, value: dict, known: set[str]) -> None:
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValidationError(f"{where} has unknown key {quoted(unknown[0])} (it takes {', '.join(sorted(known))})",
                              param=f"{where}.{unknown[0][:QUOTE_CHARS]}", value=unknown[0])


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint: OpenAI's response_format or vLLM's structured_outputs (not both)."""
    fmt = req.response_format
    kind = None if fmt is None else fmt.get("type", "text")
    if kind not in (None, *RESPONSE_FORMAT_KEYS):
        raise ValidationError.bad_value("response_format.type", kind, "'text', 'json_object' or 'json_schema'")
    if kind is not None:
        _unknown_key("response_format", fmt, RESPONSE_FORMAT_KEYS[kind])
    if req.structured_outputs is not None:
        if kind not in (None, "text"):
            raise ValidationError("give response_format or structured_outputs, not both", param="structured_outputs")
        try:
            return StructuredOutputsParams(**req.structured_outputs)
        except TypeError as e:
            raise ValidationError(f"structured_outputs: {e}", param="structured_outputs") from None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ValidationError.bad_value("response_format.json_schema", spec, "an object with a schema")
        _unknown_key("response_format.json_schema", spec, JSON_SCHEMA_KEYS)
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise ValidationError.bad_value("response_format.json_schema.schema", schema, "a JSON schema object")
        return StructuredOutputsParams(json=schema)
    return None


def constraint_param(req: SamplingFields, spec: StructuredOutputsParams) -> str:
    """Where the request gave its constraint, as an error's param."""
    if req.structured_outputs is not None:
        return f"structured_outputs.{spec.kind}"
    return "response_format.json_schema.schema" if spec.kind == "json" else "response_format"
