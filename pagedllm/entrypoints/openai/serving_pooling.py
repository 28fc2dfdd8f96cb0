"""POST /v1/embeddings, /pooling, /classify, /score and /rerank: a pooling model's vectors, classes and pair
scores (vLLM's endpoints and shapes). Each input is one engine request, all queued at once; a request is
checked against the model's pooling tasks and the server's limits before anything is tokenized."""
from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.config import ModelConfig
from pagedllm.engine.processor import PromptType
from pagedllm.engine.scoring import cosine, pair_prompt, score_pairs
from pagedllm.entrypoints.openai.limits import check_count
from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.protocol_pooling import (ClassificationData, ClassificationRequest,
                                                          ClassificationResponse, EmbeddingData, EmbeddingRequest,
                                                          EmbeddingResponse, PoolingData, PoolingInput,
                                                          PoolingRequest, PoolingResponse, PoolingUsage,
                                                          RerankDocument, RerankRequest, RerankResponse, RerankResult,
                                                          RerankUsage, ScoreData, ScoreRequest, ScoreResponse)
from pagedllm.entrypoints.openai.serving import OpenAIServing
from pagedllm.errors import ValidationError, quoted
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

GONE = 499
"""The status of a request whose client left before its answer (nobody reads it)."""


def endpoints_for(tasks: Sequence[str]) -> str:
    """The endpoints a model with these pooling tasks serves, for an error message ("use ...")."""
    if not tasks:
        return "it generates text: use /v1/completions or /v1/chat/completions"
    names = [name for task, name in (("embed", "/v1/embeddings"), ("score", "/v1/score"), ("score", "/rerank"),
                                     ("classify", "/classify")) if task in tasks]
    return "use " + (names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1])


def check_generates(model: ModelConfig, endpoint: str) -> None:
    """A generation endpoint on a pooling model: ValidationError (400, param "model") naming the endpoints to use,
    before the request is prepared (a BERT model has no chat template to refuse it with)."""
    if model.runner == "pooling":
        raise ValidationError(f"this model is a pooling model ({model.convert}): it does not serve {endpoint}; "
                              f"{endpoints_for(model.pooling_tasks)} (or /pooling)", param="model")


def encode_vector(data: list[float], encoding_format: str) -> list[float] | str:
    """A vector as JSON floats, or base64 of its little-endian float32 bytes (OpenAI's "base64")."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(data, dtype="<f4").tobytes()).decode("ascii")
    return data


def _usage(outputs: list[PoolingRequestOutput]) -> PoolingUsage:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return PoolingUsage(prompt_tokens=tokens, total_tokens=tokens)


class OpenAIServingPooling(OpenAIServing):
    """The pooling endpoints (see the module docstring)."""

    # ------------------------------------------------------------------ endpoints
    async def embed(self, req: EmbeddingRequest, raw: Request) -> Response:
        """OpenAI's embeddings: one vector per input, in input order."""
        model = self._check(req.model, "embed", raw.url.path)
        prompts = self._prompts(req.input, "input")
        params = PoolingParams(task="embed", dimensions=req.dimensions, normalize=req.normalize,
                               truncate_prompt_tokens=self._truncate(req.truncate_prompt_tokens))
        request_id = random_id("embd")
        outputs = await self._run(request_id, prompts, params, raw)
        if outputs is None:
            return Response(status_code=GONE)
        data = [EmbeddingData(embedding=encode_vector(o.outputs.data, req.encoding_format), index=i)
                for i, o in enumerate(outputs)]
        return _json(EmbeddingResponse(id=request_id, model=model, data=data, usage=_usage(outputs)))

    async def pool(self, req: PoolingRequest, raw: Request) -> Response:
        """vLLM's /pooling: each input's vector in the model's own task."""
        model = self._check(req.model, None, raw.url.path)
        prompts = self._prompts(req.input, "input")
        params = PoolingParams(truncate_prompt_tokens=self._truncate(req.truncate_prompt_tokens))
        request_id = random_id("pool")
        outputs = await self._run(request_id, prompts, params, raw)
        if outputs is None:
            return Response(status_code=GONE)
        data = [PoolingData(index=i, data=encode_vector(o.outputs.data, req.encoding_format))
                for i, o in enumerate(outputs)]
        return _json(PoolingResponse(id=request_id, model=model, data=data, usage=_usage(outputs)))

    async def classify(self, req: ClassificationRequest, raw: Request) -> Response:
        """vLLM's /classify: each text's class probabilities and its most likely label."""
        model = self._check(req.model, "classify", raw.url.path)
        prompts = self._prompts(req.input, "input")
        params = PoolingParams(task="classify", use_activation=req.use_activation,
                               truncate_prompt_tokens=self._truncate(req.truncate_prompt_tokens))
        request_id = random_id("classify")
        outputs = await self._run(request_id, prompts, params, raw)
        if outputs is None:
            return Response(status_code=GONE)
        labels = self.engine.config.model.labels
        data = []
        for i, o in enumerate(outputs):
            probs = o.outputs.data
            best = int(np.argmax(probs))
            label = labels[best] if best < len(labels) else f"LABEL_{best}"
            data.append(ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs)))
        return _json(ClassificationResponse(id=request_id, model=model, data=data, usage=_usage(outputs)))

    async def score(self, req: ScoreRequest, raw: Request) -> Response:
        """vLLM's /score: one score per pair, in pair order."""
        model = self._check(req.model, "score", raw.url.path)
        (name_1, texts_1), (name_2, texts_2) = req.sides()
        request_id = random_id("score")
        result = await self._scores(request_id, (texts_1, texts_2), (name_1, name_2), req.truncate_prompt_tokens,
                                    req.use_activation, raw)
        if result is None:
            return Response(status_code=GONE)
        scores, usage = result
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores)]
        return _json(ScoreResponse(id=request_id, model=model, data=data, usage=usage))

    async def rerank(self, req: RerankRequest, raw: Request) -> Response:
        """Jina's / Cohere's rerank: the documents by relevance to the query, best first, cut to top_n."""
        model = self._check(req.model, "score", raw.url.path)
        if req.top_n is not None and req.top_n < 0:
            raise ValidationError.bad_value("top_n", req.top_n, "a positive integer, or 0 or null for all documents")
        request_id = random_id("rerank")
        result = await self._scores(request_id, (req.query, req.documents), ("query", "documents"),
                                    req.truncate_prompt_tokens, req.use_activation, raw)
        if result is None:
            return Response(status_code=GONE)
        scores, usage = result
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[:req.top_n or None]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
                   for i in order]
        body = RerankResponse(id=request_id, model=model, usage=RerankUsage(total_tokens=usage.total_tokens),
                              results=results)
        return JSONResponse(body.model_dump(exclude_none=True))

    # ------------------------------------------------------------------ shared steps
    def _check(self, model: str | None, task: str | None, endpoint: str) -> str:
        """The model name to answer with, once the model is known to serve ``task`` (None: any pooling task);
        else ValidationError (param "model") naming the endpoints it does serve."""
        name, lora = self.check_model(model)
        if lora is not None:
            raise ValidationError(f"{quoted(model)} is a LoRA adapter: pooling requests run the base model only",
                                  param="model", value=model)
        tasks = self.engine.config.model.pooling_tasks
        if not tasks or (task is not None and task not in tasks):
            raise ValidationError(f"this model does not serve {endpoint}: {endpoints_for(tasks)}", param="model",
                                  value=name)
        return name

    def _prompts(self, value: PoolingInput, param: str) -> list[PromptType]:
        """One engine prompt per input: a text, or {"prompt_token_ids": ids}; at most --max-prompts of them, each
        non-empty, its text within the prompt-size cap (before anything is tokenized), its ids in the vocabulary."""
        if isinstance(value, str):
            self._check_text(value, param)
            return [value]
        if not value:
            raise ValidationError(f"{param} must not be empty", param=param, value=value)
        if isinstance(value[0], int):
            self._check_ids(value, param)
            return [{"prompt_token_ids": value}]
        check_count(value, self.limits.max_prompts, param, "--max-prompts")
        prompts: list[PromptType] = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                self._check_text(item, f"{param}[{i}]")
                prompts.append(item)
            elif not item:
                raise ValidationError(f"{param}[{i}] must not be empty", param=f"{param}[{i}]", value=item)
            else:
                self._check_ids(item, f"{param}[{i}]")
                prompts.append({"prompt_token_ids": item})
        return prompts

    def _check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.processor.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValidationError(f"{param} contains token id {bad}, outside the vocabulary [0, {vocab})",
                                  param=param, value=bad)

    def _check_text(self, text: str, param: str) -> None:
        if not text:
            raise ValidationError(f"{param} must not be empty", param=param, value=text)
        self.check_prompt_size(text, param)

    def _truncate(self, tokens: int | None) -> int | None:
        """truncate_prompt_tokens within max_model_len (PoolingParams checks the rest)."""
        if tokens is not None and tokens > self.max_model_len:
            raise ValidationError.bad_value("truncate_prompt_tokens", tokens,
                                            f"at most max_model_len ({self.max_model_len}), or -1 for max_model_len")
        return tokens

    async def _run(self, request_id: str, prompts: list[PromptType], params: PoolingParams,
                   raw: Request) -> list[PoolingRequestOutput] | None:
        """Each prompt's output in prompt order (None if the client left first); one failed prompt fails the
        request (a 400 or a 500), the others are withdrawn."""
        streams = await self.add_all(request_id, prompts, params, None, raw)  # type: ignore[arg-type]
        if streams is None:
            return None
        return await self.outputs(streams, raw)  # type: ignore[return-value]

    async def _scores(self, request_id: str, sides: tuple[str | list[str], str | list[str]], names: tuple[str, str],
                      truncate: int | None, use_activation: bool | None, raw: Request
                      ) -> tuple[list[float], PoolingUsage] | None:
        """The score of each pair (vLLM's pairing) and the tokens run: an embedding model's cosine of the two
        texts' embeddings (each distinct text embedded once), or a cross-encoder's output for the pair."""
        for name, texts in zip(names, sides):
            if isinstance(texts, list):
                check_count(texts, self.limits.max_prompts, name, "--max-prompts")
            for i, text in enumerate([texts] if isinstance(texts, str) else texts):
                self._check_text(text, name if isinstance(texts, str) else f"{name}[{i}]")
        pairs = score_pairs(sides[0], sides[1], names)
        truncate = self._truncate(truncate)
        if self.engine.config.model.convert == "embed":
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            params = PoolingParams(task="score", use_activation=use_activation, truncate_prompt_tokens=truncate)
            outputs = await self._run(request_id, texts, params, raw)
            if outputs is None:
                return None
            vectors = {t: o.outputs.data for t, o in zip(texts, outputs)}
            return [cosine(vectors[a], vectors[b]) for a, b in pairs], _usage(outputs)
        # a pair is cut while it is tokenized (the longer text first), so the engine is not asked to cut it again
        prompts: list[PromptType] = await self.engine.in_tokenizer_thread(
            lambda: [pair_prompt(self.tokenizer, a, b, truncate, self.max_model_len) for a, b in pairs])
        params = PoolingParams(task="score", use_activation=use_activation)
        outputs = await self._run(request_id, prompts, params, raw)
        if outputs is None:
            return None
        return [o.outputs.data[0] for o in outputs], _usage(outputs)


def _json(body: BaseModel) -> JSONResponse:
    return JSONResponse(body.model_dump())
