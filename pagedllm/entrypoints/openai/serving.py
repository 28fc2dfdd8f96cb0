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

from pagedllm.engine.async_engine import EngineDeadError, RequestStream
from pagedllm.engine.core_client import ServingEngine
from pagedllm.engine.processor import PromptType
from pagedllm.errors import ValidationError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, SamplingFields
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

T = TypeVar("T")

BYTES_PER_TOKEN_CAP = 64
"""Default prompt cap: 64 bytes of text per token of max_model_len (English averages ~4 bytes per token, so a
prompt over the cap could only fit the model's context in a pathological tokenization)."""


@dataclasses.dataclass(frozen=True)
class ServingLimits:
    """What the server refuses before it costs the engine anything (``pagedllm serve`` options)."""

    max_waiting_requests: int | None = None
    """More requests than this waiting to be scheduled (new, or preempted back to the queue): new ones get 503
    with Retry-After (None: no limit)."""
    request_timeout: float | None = None
    """Seconds a request may take from being queued to its last token; then it is aborted (504, or an error
    event on a stream). None: no limit."""
    max_prompt_bytes: int | None = None
    """UTF-8 bytes of prompt text (a completion's prompts, a chat's messages) checked before tokenizing (400).
    None: BYTES_PER_TOKEN_CAP per token of max_model_len."""


class OverloadedError(Exception):
    """The waiting queue is full: the request is refused with 503 and Retry-After, nothing else is touched."""

    retry_after = 1
    """Seconds the client is asked to wait (a step or a few: the queue drains at every step)."""


class RequestTimeoutError(Exception):
    """The request outlived --request-timeout: it was aborted (its blocks freed)."""


def text_bytes(value: Any) -> int:
    """UTF-8 bytes of every string in a request field (strings, lists, dicts, pydantic models)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, BaseModel):
        value = dict(value)
    if isinstance(value, dict):
        return sum(text_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_bytes(v) for v in value)
    return 0


class OpenAIServing:
    """What both endpoints need from the engine."""

    def __init__(self, engine: ServingEngine, models: OpenAIServingModels,
                 limits: ServingLimits | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.model.max_model_len
        self.models = models
        self.limits = limits or ServingLimits()
        self.on_refused: Callable[[str], None] = lambda reason: None
        """Told of every request shed here: "overloaded" or "timeout" (the server's metrics)."""

    def check_prompt_size(self, value: Any, param: str) -> None:
        """ValidationError (400) when the prompt text of ``value`` is over the byte cap, before any tokenizing."""
        cap = self.limits.max_prompt_bytes or BYTES_PER_TOKEN_CAP * self.max_model_len
        size = text_bytes(value)
        if size > cap:
            raise ValidationError(f"{param} is {size} bytes of text, over this server's cap of {cap} bytes "
                                  f"(max_model_len is {self.max_model_len} tokens)", param=param)

    async def outputs(self, streams: list[RequestStream], raw: Request) -> list[RequestOutput] | None:
        """Every stream's final output (None if the client disconnected first), within the request timeout."""
        try:
            return await unless_disconnected(final_outputs(streams, self.limits.request_timeout), raw)
        except RequestTimeoutError:
            self.on_refused("timeout")
            raise

    async def with_error_events(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream's events; a timeout or a dead engine after the response started becomes an error event in
        OpenAI's error shape, then [DONE] (the status line was already sent)."""
        try:
            async for event in events:
                yield event
        except (RequestTimeoutError, EngineDeadError) as e:
            timeout = isinstance(e, RequestTimeoutError)
            if timeout:
                self.on_refused("timeout")
            error = ErrorInfo(message=str(e), type="timeout_error" if timeout else "server_error",
                              code="request_timeout" if timeout else "engine_dead")
            yield sse(ErrorResponse(error=error))
            yield SSE_DONE

    def check_model(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """(the model name to answer with, the LoRA adapter it names or None); a name we do not serve raises
        ModelNotFoundError."""
        return self.models.resolve(model)

    def sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        stream: bool, prompt_logprobs: int | None = None) -> SamplingParams:
        """SamplingParams from the request's fields (SamplingParams names any out-of-range field)."""
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
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            structured_outputs=structured_outputs(req),
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)

    async def add_all(self, request_id: str, prompts: list[PromptType], params: SamplingParams | BeamSearchParams,
                      lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """Queue every prompt; if one is refused, withdraw the others and raise its ValidationError. Over the
        waiting limit, nothing is queued: OverloadedError."""
        limit = self.limits.max_waiting_requests
        if limit is not None and len(prompts) > limit:  # could never be admitted: not a matter of waiting
            raise ValidationError(f"{len(prompts)} prompts in one request: this server queues at most {limit} "
                                  "(--max-waiting-requests)", param="prompt")
        if limit is not None and self.engine.num_waiting + len(prompts) > limit:
            self.on_refused("overloaded")
            raise OverloadedError(f"the server is at its limit of {limit} waiting requests "
                                  f"({self.engine.num_waiting} waiting); retry in a moment")
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(f"{request_id}-{i}", prompt, params,
                                                             lora_request=lora_request))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    @staticmethod
    def top_entries(entry: dict[int, Logprob], top_n: int) -> list[tuple[int, Logprob]]:
        """The top-N (by rank) of one position's logprobs."""
        return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n),
                      key=lambda item: item[1].rank)[:top_n]


async def merge_streams(streams: list[RequestStream], timeout: float | None = None
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; closing this aborts them all, and so does
    ``timeout`` seconds passing before the last output (RequestTimeoutError)."""
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout

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
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


async def final_outputs(streams: list[RequestStream], timeout: float | None = None) -> list[RequestOutput]:
    """The finished output of every stream, in prompt order (RequestTimeoutError after ``timeout`` seconds)."""
    results: list[RequestOutput | None] = [None] * len(streams)
    async for index, out in merge_streams(streams, timeout):
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


def sse(payload: Any) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return f"data: {payload.model_dump_json()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint: OpenAI's response_format or vLLM's structured_outputs (not both)."""
    fmt = req.response_format
    kind = None if fmt is None else fmt.get("type", "text")
    if kind not in (None, "text", "json_object", "json_schema"):
        raise ValidationError.bad_value("response_format", kind, "'text', 'json_object' or 'json_schema'")
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
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise ValidationError.bad_value("response_format.json_schema.schema", schema, "a JSON schema object")
        return StructuredOutputsParams(json=schema)
    return None
