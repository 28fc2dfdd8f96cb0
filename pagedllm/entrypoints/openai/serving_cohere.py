"""POST /v2/embed: Cohere's embed API on an embedding model, as vLLM serves it. ``texts`` are embedded as
/v1/embeddings embeds them (the same vectors and token counts), with ``input_type``'s prefix from the model's
prompts before each (as a system message where the model has a chat template); text-only ``inputs`` are
rendered through the chat template as one user message each. ``truncate`` cuts at the end (END, the default),
the start (START) or refuses a text over the limit (NONE); ``embedding_types`` picks the encodings returned."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.engine.processor import PromptType
from pagedllm.entrypoints.openai.embed_chunks import COHERE_EMBEDDING_TYPES, cohere_encode
from pagedllm.entrypoints.openai.limits import check_count
from pagedllm.entrypoints.openai.protocol import ChatMessage, ContentPart, random_id
from pagedllm.entrypoints.openai.protocol_cohere import (
    CohereBilledUnits,
    CohereEmbeddings,
    CohereEmbedRequest,
    CohereEmbedResponse,
    CohereMeta,
)
from pagedllm.entrypoints.openai.serving_pooling import GONE, OpenAIServingPooling
from pagedllm.errors import ValidationError
from pagedllm.pooling_params import PoolingParams


class CohereServingEmbed:
    """/v2/embed over the pooling endpoints' machinery (limits, chunked long texts, the chat renderer)."""

    def __init__(self, pooling: OpenAIServingPooling) -> None:
        self.pooling = pooling
        pooler = pooling.engine.config.model.pooler
        self.task_prompts: dict[str, str] = dict(pooler.task_prompts) if pooler is not None else {}
        """input_type -> the prefix put before each text (the model folder's prompts; empty: none)."""

    async def embed(self, req: CohereEmbedRequest, raw: Request) -> Response:
        """Cohere's embed response: the embeddings in each requested type, the texts echoed, the tokens billed."""
        pooling = self.pooling
        pooling._check(req.model, "embed", raw.url.path)  # (Cohere's answer does not name the model)
        kinds = self._embedding_types(req.embedding_types)
        if req.priority != 0:
            raise ValidationError.bad_value("priority", req.priority, "0 (this server does not schedule by priority)")
        limit = self._limit(req)
        prompts, names = await self._prompts(req)
        request_id = random_id("embd")
        params = PoolingParams(task="embed", dimensions=req.output_dimension)
        if req.truncate != "NONE":  # the limit is applied here, at the side asked for: nothing is chunked
            prompts = await pooling.engine.in_tokenizer_thread(self._cut, prompts, limit, req.truncate == "START")
        else:  # NONE: a text over max_tokens (else over what the server embeds: max_embed_len, chunks) refused
            pooler = pooling.engine.config.model.pooler
            most = req.max_tokens if req.max_tokens is not None else \
                None if pooler is not None and pooler.enable_chunked_processing else pooling.embed_len
            tokenized = await pooling.tokenized(prompts)
            for prompt, name in zip(tokenized, names):
                n = len(prompt["prompt_token_ids"])
                if most is not None and n > most:
                    what = f"max_tokens ({most})" if req.max_tokens is not None else f"this server's limit ({most})"
                    raise ValidationError(f"{name} has {n} tokens, over {what} with truncate=NONE: set truncate "
                                          "to END or START to cut it", param=name, value=n)
            prompts = tokenized  # type: ignore[assignment]
        try:
            result = await pooling.embed_prompts(request_id, prompts, names, params, raw)
        except ValidationError as e:
            if e.param == "dimensions":  # Cohere's name of it
                raise ValidationError(e.message.replace("dimensions", "output_dimension"), param="output_dimension",
                                      value=req.output_dimension) from None
            raise
        if result is None:
            return Response(status_code=GONE)
        vectors, usage = result
        try:
            embeddings = CohereEmbeddings(**{kind: cohere_encode(vectors, kind) for kind in kinds})
        except ValueError as e:
            raise ValidationError(f"embedding_types: {e}", param="embedding_types") from None
        body = CohereEmbedResponse(id=request_id, embeddings=embeddings, texts=req.texts,
                                   meta=CohereMeta(billed_units=CohereBilledUnits(input_tokens=usage.prompt_tokens)))
        return JSONResponse(body.model_dump(exclude_none=True))

    # ------------------------------------------------------------------ request checks
    @staticmethod
    def _embedding_types(kinds: list[str] | None) -> list[str]:
        if kinds is None:
            return ["float"]
        if not kinds:
            raise ValidationError("embedding_types must not be empty (leave it out for float)",
                                  param="embedding_types", value=kinds)
        for kind in kinds:
            if kind not in COHERE_EMBEDDING_TYPES:
                raise ValidationError(f"embedding type {kind!r} is not supported: this server returns "
                                      f"{list(COHERE_EMBEDDING_TYPES)} (int8 and uint8 are Cohere's own "
                                      "calibrated quantizations)", param="embedding_types", value=kind)
        return list(dict.fromkeys(kinds))

    def _limit(self, req: CohereEmbedRequest) -> int:
        """The token limit ``truncate`` applies: max_tokens, at most max_model_len."""
        most = self.pooling.max_model_len
        if req.max_tokens is None:
            return most
        if req.max_tokens < 1 or (req.truncate != "NONE" and req.max_tokens > most):
            raise ValidationError.bad_value("max_tokens", req.max_tokens, f"1 .. max_model_len ({most})")
        return req.max_tokens

    def _prefix(self, input_type: str | None) -> str | None:
        """The prefix of ``input_type`` (None: no input_type, or an empty prefix); 400 for one the model lacks."""
        if input_type is None:
            return None
        if input_type not in self.task_prompts:
            known = (f"supported values: {sorted(self.task_prompts)}" if self.task_prompts else
                     "this model defines no input types (no prompts in config_sentence_transformers.json)")
            raise ValidationError(f"Unsupported input_type {input_type!r}: {known}", param="input_type",
                                  value=input_type)
        return self.task_prompts[input_type] or None

    # ------------------------------------------------------------------ prompts
    async def _prompts(self, req: CohereEmbedRequest) -> tuple[list[PromptType], list[str]]:
        """The prompts of texts or inputs, and the field each came from."""
        given = [name for name in ("texts", "images", "inputs") if getattr(req, name) is not None]
        if len(given) != 1 or not getattr(req, given[0]):
            raise ValidationError("give exactly one of texts, images and inputs, not empty",
                                  param=given[0] if len(given) == 1 else "texts")
        if req.images is not None:
            raise ValidationError("images are not supported: this server runs no vision models", param="images")
        pooling = self.pooling
        prefix = self._prefix(req.input_type)
        if req.texts is not None:
            check_count(req.texts, pooling.limits.max_prompts, "texts", "--max-prompts")
            names = [f"texts[{i}]" for i in range(len(req.texts))]
            for text, name in zip(req.texts, names):
                pooling._check_text(text, name, pooling._byte_cap_tokens(True))
            if prefix is None or not self._has_template():
                return [text if prefix is None else prefix + text for text in req.texts], names
            conversations = [self._messages(prefix, [text]) for text in req.texts]
        else:
            assert req.inputs is not None
            check_count(req.inputs, pooling.limits.max_prompts, "inputs", "--max-prompts")
            conversations = []
            for i, item in enumerate(req.inputs):
                texts = []
                for j, part in enumerate(item.content):
                    if part.type != "text" or part.text is None:
                        raise ValidationError(f"inputs[{i}].content[{j}]: only text parts are supported (this "
                                              f"server runs no vision models), got {part.type!r}",
                                              param=f"inputs[{i}].content[{j}]", value=part.type)
                    pooling._check_text(part.text, f"inputs[{i}].content[{j}].text", pooling._byte_cap_tokens(True))
                    texts.append(part.text)
                conversations.append(self._messages(prefix, texts))
            names = [f"inputs[{i}]" for i in range(len(req.inputs))]
        return await self._render(conversations), names

    def _has_template(self) -> bool:
        chat = self.pooling.chat
        return chat is not None and (chat.chat_template is not None
                                     or getattr(self.pooling.tokenizer, "chat_template", None) is not None)

    @staticmethod
    def _messages(prefix: str | None, texts: list[str]) -> list[ChatMessage]:
        """A user message of ``texts``' parts, after a system message of the prefix (if any)."""
        user = ChatMessage(role="user", content=[ContentPart(type="text", text=t) for t in texts])
        return ([ChatMessage(role="system", content=prefix)] if prefix else []) + [user]

    async def _render(self, conversations: list[list[ChatMessage]]) -> list[PromptType]:
        """Each conversation through the chat template (no generation prompt), as token ids."""
        chat = self.pooling.chat
        if chat is None:
            raise ValidationError("inputs are rendered through the chat template, which this server lacks",
                                  param="inputs")
        def render() -> list[PromptType]:
            out: list[PromptType] = []
            for messages in conversations:
                text, ids = chat.apply_chat_template(messages, False)
                out.append({"prompt_token_ids": list(ids), "prompt": text})
            return out

        return await self.pooling.engine.in_tokenizer_thread(render)

    def _cut(self, prompts: list[PromptType], limit: int, from_start: bool) -> list[PromptType]:
        """Each prompt at most ``limit`` tokens: its tokens cut at the end (or the start), keeping the special
        tokens the tokenizer put around them (as a tokenizer's own truncation does). Runs in the tokenizer thread."""
        special = set(getattr(self.pooling.tokenizer, "all_special_ids", ()) or ())
        out: list[PromptType] = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids, text = self.pooling.tokenizer.encode(prompt), prompt
            else:
                ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")  # type: ignore[index]
            if len(ids) > limit:
                head = next((k for k, t in enumerate(ids) if t not in special), len(ids))
                tail = next((k for k, t in enumerate(reversed(ids)) if t not in special), 0)
                if head + tail >= limit:  # a limit shorter than the special tokens themselves: plain cut
                    head = tail = 0
                keep = limit - head - tail
                body = ids[head:len(ids) - tail]
                ids = ids[:head] + (body[-keep:] if from_start else body[:keep]) + ids[len(ids) - tail:]
            out.append({"prompt_token_ids": ids, "prompt": text})
        return out
