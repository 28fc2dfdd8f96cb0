"""Request handling shared by the completion and chat endpoints: validation, sampling params,
fan-out of several prompts, streaming and abort on disconnect."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from pagedllm.engine.async_engine import AsyncLLMEngine, RequestStream
from pagedllm.engine.processor import PromptType
from pagedllm.errors import ValidationError
from pagedllm.entrypoints.openai.protocol import SamplingFields
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

T = TypeVar("T")


class OpenAIServing:
    """What both endpoints need from the engine."""

    def __init__(self, engine: AsyncLLMEngine, models: OpenAIServingModels) -> None:
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.config.model.max_model_len
        self.models = models

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
        """Queue every prompt; if one is refused, withdraw the others and raise its ValidationError."""
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


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; closing this aborts them all."""
    queue: asyncio.Queue = asyncio.Queue()

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
            index, item = await queue.get()
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


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """The finished output of every stream, in prompt order."""
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
