"""POST /v1/embeddings, /pooling, /classify, /score and /rerank: a pooling model's vectors, classes and pair
scores (vLLM's endpoints and shapes). Each input is one engine request, all queued at once; a request is
checked against the model's pooling tasks and the server's limits before anything is tokenized."""
from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.config import ModelConfig
from pagedllm.engine.processor import PromptType
from pagedllm.engine.scoring import cosine, pair_prompt, score_pairs
from pagedllm.entrypoints.openai.chat_options import template_options
from pagedllm.entrypoints.openai.embed_chunks import combine_chunks, split_chunks
from pagedllm.entrypoints.openai.limits import BYTES_PER_TOKEN_CAP, check_count
from pagedllm.entrypoints.openai.protocol import random_id
from pagedllm.entrypoints.openai.protocol_pooling import (
    ChatInputFields,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingData,
    PoolingInput,
    PoolingRequest,
    PoolingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from pagedllm.entrypoints.openai.serving import OpenAIServing
from pagedllm.errors import ValidationError, quoted
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

if TYPE_CHECKING:
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat

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

    chat: OpenAIServingChat | None = None
    """The chat endpoint's renderer (its template, --chat-template, --trust-request-chat-template): ``messages``
    inputs are rendered by it; None: they are refused."""

    # ------------------------------------------------------------------ endpoints
    async def embed(self, req: EmbeddingRequest, raw: Request) -> Response:
        """OpenAI's embeddings: one vector per input, in input order (texts, token ids or conversations; inputs
        longer than max_model_len embedded in chunks where the server enables it)."""
        model = self._check(req.model, "embed", raw.url.path)
        params = PoolingParams(task="embed", dimensions=req.dimensions, normalize=req.normalized(),
                               truncate_prompt_tokens=self._truncate(req.truncate_prompt_tokens))
        prompts, names = await self._inputs(req, embed=True)
        request_id = random_id("embd")
        result = await self.embed_prompts(request_id, prompts, names, params, raw)
        if result is None:
            return Response(status_code=GONE)
        vectors, usage = result
        data = [EmbeddingData(embedding=encode_vector(v, req.encoding_format), index=i) for i, v in enumerate(vectors)]
        return _json(EmbeddingResponse(id=request_id, model=model, data=data, usage=usage))

    async def pool(self, req: PoolingRequest, raw: Request) -> Response:
        """vLLM's /pooling: each input's vector in the model's own task."""
        model = self._check(req.model, None, raw.url.path)
        params = PoolingParams(truncate_prompt_tokens=self._truncate(req.truncate_prompt_tokens))
        prompts, _ = await self._inputs(req, embed=False)
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

    # ------------------------------------------------------------------ inputs and long texts
    @property
    def embed_len(self) -> int | None:
        """Most tokens of one embeddings input: max_embed_len, else max_model_len (with chunked processing and
        no max_embed_len: None, the prompt byte cap bounds an input)."""
        pooler = self.engine.config.model.pooler
        if pooler is None or pooler.max_embed_len is None:
            return None if pooler is not None and pooler.enable_chunked_processing else self.max_model_len
        return pooler.max_embed_len if pooler.enable_chunked_processing else min(pooler.max_embed_len,
                                                                                 self.max_model_len)

    def _byte_cap_tokens(self, embed: bool) -> int:
        """The token length the prompt byte cap of an input is sized for (max_embed_len for embeddings)."""
        return max(self.embed_len or 0, self.max_model_len) if embed else self.max_model_len

    async def _inputs(self, req: ChatInputFields, embed: bool) -> tuple[list[PromptType], list[str]]:
        """The request's prompts and the field each came from (for errors): its ``input`` (texts, tokenized here
        without special tokens when add_special_tokens is false), or each conversation of ``messages`` rendered
        through the chat template into token ids."""
        conversations = req.conversations()
        add_special = req.add_special_tokens
        if conversations is None:
            value = req.input
            prompts = self._prompts(value, "input", self._byte_cap_tokens(embed))  # type: ignore[arg-type]
            one = isinstance(value, str) or isinstance(value[0], int)  # type: ignore[index]
            names = ["input"] if one else [f"input[{i}]" for i in range(len(prompts))]
            if add_special is False and any(isinstance(p, str) for p in prompts):
                prompts = await self.engine.in_tokenizer_thread(self._without_special_tokens, prompts, names)
            return prompts, names
        if not embed and len(conversations) > 1:
            raise ValidationError("messages on /pooling is one conversation (a list of messages); send several "
                                  "conversations to /v1/embeddings", param="messages")
        check_count(conversations, self.limits.max_prompts, "messages", "--max-prompts")
        if self.chat is None:
            raise ValidationError("messages are not supported by this server", param="messages")
        cap = self.limits.max_prompt_bytes or BYTES_PER_TOKEN_CAP * self._byte_cap_tokens(embed)
        self.check_prompt_size(req.messages, "messages", cap)
        options = template_options(req, self.chat.trust_request_chat_template)
        chat = self.chat

        def render() -> list[PromptType]:
            prompts: list[PromptType] = []
            for messages in conversations:
                text, ids = chat.apply_chat_template(messages, req.add_generation_prompt, None, options)
                if add_special:  # as the tokenizer adds them to a plain text, on top of the template's own
                    ids = self.tokenizer.encode(text)
                if not ids:
                    raise ValidationError("messages render to an empty prompt", param="messages")
                prompts.append({"prompt_token_ids": list(ids), "prompt": text})
            return prompts

        prompts = await self.engine.in_tokenizer_thread(render)
        names = ["messages"] if len(prompts) == 1 else [f"messages[{i}]" for i in range(len(prompts))]
        return prompts, names

    def _without_special_tokens(self, prompts: list[PromptType], names: list[str]) -> list[PromptType]:
        """Each text prompt as its token ids with no special tokens added (add_special_tokens=false)."""
        out: list[PromptType] = []
        for p, name in zip(prompts, names):
            if isinstance(p, str):
                ids = self.tokenizer.encode(p, add_special_tokens=False)
                if not ids:
                    raise ValidationError(f"{name} has no tokens without its special tokens", param=name)
                out.append({"prompt_token_ids": ids, "prompt": p})
            else:
                out.append(p)
        return out

    async def embed_prompts(self, request_id: str, prompts: list[PromptType], names: list[str],
                            params: PoolingParams, raw: Request
                            ) -> tuple[list[list[float]], PoolingUsage] | None:
        """Each prompt's embedding, in order, and the tokens run (None if the client left first). Where the
        server sets max_embed_len or chunked processing, prompts are tokenized here: one over max_embed_len is
        refused naming its field, and (chunked processing) one over max_model_len embedded in chunks."""
        pooler = self.engine.config.model.pooler
        if params.truncate_prompt_tokens is not None or pooler is None or \
                (not pooler.enable_chunked_processing and pooler.max_embed_len is None):
            outputs = await self._run(request_id, prompts, params, raw)
            return None if outputs is None else ([o.outputs.data for o in outputs], _usage(outputs))
        tokenized = await self.tokenized(prompts)
        cap, size = self.embed_len, self.max_model_len
        if cap is None:  # chunked, no max_embed_len: token ids are held to what the byte cap allows of text
            cap = self.limits.max_prompt_bytes or BYTES_PER_TOKEN_CAP * self.max_model_len
        pieces: list[PromptType] = []
        owners: list[int] = []
        for i, (prompt, name) in enumerate(zip(tokenized, names)):
            ids = prompt["prompt_token_ids"]
            if len(ids) > cap:
                raise ValidationError(f"{name} has {len(ids)} tokens, over this server's limit of {cap} for one "
                                      f"embeddings input (max_embed_len of --pooler-config; max_model_len is "
                                      f"{self.max_model_len})", param=name, value=len(ids))
            chunks = split_chunks(ids, size) if pooler.enable_chunked_processing else [ids]
            if len(chunks) == 1:
                pieces.append(prompt)
            else:
                pieces.extend({"prompt_token_ids": chunk} for chunk in chunks)
            owners.extend([i] * len(chunks))
        if len(pieces) > max(self.limits.max_prompts, len(prompts)):
            raise ValidationError(f"the inputs make {len(pieces)} chunks of {size} tokens; this server runs at most "
                                  f"{self.limits.max_prompts} in one request (--max-prompts)",
                                  param=names[0] if len(names) == 1 else "input", value=len(pieces))
        outputs = await self._run(request_id, pieces, params, raw)
        if outputs is None:
            return None
        normalize = pooler.normalize if params.normalize is None else params.normalize
        per_input: list[list[PoolingRequestOutput]] = [[] for _ in tokenized]
        for output, owner in zip(outputs, owners):
            per_input[owner].append(output)
        vectors = [combine_chunks([o.outputs.data for o in mine], [len(o.prompt_token_ids) for o in mine], normalize)
                   for mine in per_input]
        return vectors, _usage(outputs)

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

    def _prompts(self, value: PoolingInput, param: str, cap_tokens: int | None = None) -> list[PromptType]:
        """One engine prompt per input: a text, or {"prompt_token_ids": ids}; at most --max-prompts of them, each
        non-empty, its text within the prompt-size cap (sized for ``cap_tokens``, default max_model_len; before
        anything is tokenized), its ids in the vocabulary."""
        if isinstance(value, str):
            self._check_text(value, param, cap_tokens)
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
                self._check_text(item, f"{param}[{i}]", cap_tokens)
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

    def _check_text(self, text: str, param: str, cap_tokens: int | None = None) -> None:
        if not text:
            raise ValidationError(f"{param} must not be empty", param=param, value=text)
        self.check_prompt_size(text, param, None if cap_tokens is None else
                               self.limits.max_prompt_bytes or BYTES_PER_TOKEN_CAP * cap_tokens)

    def _truncate(self, tokens: int | None) -> int | None:
        """truncate_prompt_tokens within max_model_len (PoolingParams checks the rest). Above it, vLLM's words
        (its clients compare the whole message)."""
        if tokens is not None and tokens > self.max_model_len:
            raise ValidationError("truncate_prompt_tokens value is greater than max_model_len. Please request a "
                                  "smaller truncation size.", param="truncate_prompt_tokens", value=tokens)
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
