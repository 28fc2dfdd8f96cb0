"""Pydantic models of the pooling endpoints, in vLLM's shapes: OpenAI's /v1/embeddings, and vLLM's /pooling,
/classify, /score and /rerank (Jina's and Cohere's rerank shape). A field we do not implement is refused (400
naming it), as everywhere on this server."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool, model_validator

from pagedllm.entrypoints.openai.protocol import ChatMessage, OpenAIModel, TokenIds
from pagedllm.errors import ValidationError

PoolingInput = str | TokenIds | list[str] | list[TokenIds]
"""A text, token ids, a list of texts or a list of token-id lists (OpenAI's embeddings input)."""
EncodingFormat = Literal["float", "base64"]
"""How vectors come back: JSON floats, or base64 of their little-endian float32 bytes (what the openai client
asks for by default)."""


def _is_conversation(value: Any) -> bool:
    """A list of chat messages (dicts with a string "role")."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)


class ChatInputFields(OpenAIModel):
    """vLLM's chat-shaped pooling input: ``messages`` (one conversation, or on /v1/embeddings a list of them)
    rendered through the chat template, each conversation one input; ``input`` may hold the conversation(s)
    instead. Exactly one of ``input`` and ``messages``."""

    input: PoolingInput | None = None
    messages: list[ChatMessage] | list[list[ChatMessage]] | None = None
    add_generation_prompt: StrictBool = False
    """Append the template's generation prompt (off by default for pooling, as vLLM)."""
    continue_final_message: StrictBool = False
    """Leave the last message open (no end-of-turn), as chat's assistant prefill."""
    add_special_tokens: StrictBool | None = None
    """Special tokens (BOS, CLS/SEP) added by the tokenizer: default true for ``input``, false for ``messages``
    (the template writes its own)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. enable_thinking)."""
    chat_template: str | None = None
    """The request's own template (needs --trust-request-chat-template, as on chat)."""

    @model_validator(mode="before")
    @classmethod
    def _conversation_in_input(cls, data: Any) -> Any:
        """A conversation (or a list of them) sent as ``input`` is read as ``messages``, as vLLM does."""
        if isinstance(data, dict) and "messages" not in data:
            value = data.get("input")
            if _is_conversation(value) or (isinstance(value, list) and bool(value)
                                           and all(_is_conversation(c) for c in value)):
                data = {k: v for k, v in data.items() if k != "input"} | {"messages": value}
        return data

    def _check_no_chat_fields(self) -> None:
        """A request with plain ``input`` sets none of the fields that render messages."""
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template"):
            if getattr(self, name) not in (None, False):
                raise ValidationError(f"{name} is for messages (a conversation rendered through the chat "
                                      "template), not for input", param=name, value=getattr(self, name))

    def conversations(self) -> list[list[ChatMessage]] | None:
        """The conversations to render (None: the request has plain ``input``); ValidationError naming the field
        when both or neither of input and messages are given, or both prompt flags are set."""
        if (self.input is None) == (self.messages is None):
            raise ValidationError("give exactly one of input and messages" if self.input is not None else
                                  "input (or messages) is required", param="input" if self.input is None
                                  else "messages")
        if self.messages is None:
            self._check_no_chat_fields()
            return None
        if self.continue_final_message and self.add_generation_prompt:
            raise ValidationError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                  param="continue_final_message", value=True)
        if not self.messages:
            raise ValidationError("messages must not be empty", param="messages", value=[])
        if isinstance(self.messages[0], list):
            return self.messages  # type: ignore[return-value]
        return [self.messages]  # type: ignore[list-item]


class EmbeddingRequest(ChatInputFields):
    """POST /v1/embeddings (OpenAI's, with vLLM's truncate_prompt_tokens, normalize and chat-shaped input)."""

    model: str | None = None
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None
    """Keep the first this many values (Matryoshka models only; others refuse it)."""
    user: str | None = None
    """Accepted and ignored, as OpenAI does."""
    truncate_prompt_tokens: int | None = None
    """vLLM's extra: keep the last this many tokens of each input (-1: max_model_len); unset, a longer input is a
    400 naming ``input``."""
    normalize: StrictBool | None = None
    """vLLM's extra: scale to unit length (unset: as the model's sentence-transformers config says)."""
    use_activation: StrictBool | None = None
    """vLLM 0.34's name of ``normalize`` on embeddings (give one of them)."""

    def normalized(self) -> bool | None:
        """normalize or use_activation (None: the model's default); ValidationError when both are given."""
        if self.normalize is not None and self.use_activation is not None:
            raise ValidationError("give normalize or use_activation (vLLM's newer name of it), not both",
                                  param="use_activation", value=self.use_activation)
        return self.normalize if self.use_activation is None else self.use_activation


class PoolingRequest(ChatInputFields):
    """POST /pooling (vLLM's): each input's vector in the model's own task (an embedding, class probabilities);
    ``messages`` is one conversation here (vLLM's)."""

    model: str | None = None
    encoding_format: EncodingFormat = "float"
    user: str | None = None
    truncate_prompt_tokens: int | None = None


class ClassificationRequest(OpenAIModel):
    """POST /classify (vLLM's): each text's class probabilities and most likely label."""

    model: str | None = None
    input: str | list[str]
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: StrictBool | None = None
    """vLLM's: false returns the raw logits (default: softmax, or a sigmoid for one class)."""


class ScoreRequest(OpenAIModel):
    """POST /score and /v1/score (vLLM's): the score of each pair, one text against each of the others (1 -> N) or
    text i against text i (N -> N). The two sides are text_1 / text_2, or vLLM's newer queries / documents or
    data_1 / data_2: exactly one of those pairs."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: StrictBool | None = None
    """A cross-encoder's: false returns its raw logit (default: a sigmoid)."""

    def sides(self) -> tuple[tuple[str, str | list[str]], tuple[str, str | list[str]]]:
        """((name, texts), (name, texts)) of the one pair of fields given (ValidationError naming the problem)."""
        given = [(a, b) for a, b in (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2"))
                 if getattr(self, a) is not None or getattr(self, b) is not None]
        if len(given) != 1:
            names = " and ".join(f"{a}/{b}" for a, b in given) if given else "none of them"
            raise ValidationError(f"give exactly one of text_1/text_2, queries/documents or data_1/data_2 "
                                  f"(got {names})", param=given[-1][0] if given else "text_1")
        first, second = given[0]
        for name in given[0]:
            if getattr(self, name) is None:
                raise ValidationError(f"{name} is missing (it goes with {first if name == second else second})",
                                      param=name)
        return (first, getattr(self, first)), (second, getattr(self, second))


class RerankRequest(OpenAIModel):
    """POST /rerank, /v1/rerank and /v2/rerank (Jina's and Cohere's shape, as vLLM serves it)."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    """The best this many results (unset or 0: all of them)."""
    return_documents: StrictBool = True
    """Each result carries its document's text (false: left out)."""
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: StrictBool | None = None


class PoolingUsage(BaseModel):
    """Tokens of every input run (OpenAI's embeddings usage)."""

    prompt_tokens: int
    total_tokens: int


def _created() -> int:
    return int(time.time())


class _ListResponse(BaseModel):
    """What every pooling endpoint's answer has besides its ``data`` list (vLLM's fields)."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_created)
    model: str
    usage: PoolingUsage


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str
    index: int


class EmbeddingResponse(_ListResponse):
    data: list[EmbeddingData]


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(_ListResponse):
    data: list[PoolingData]


class ClassificationData(BaseModel):
    index: int
    label: str
    """The most likely class's name (the model's id2label)."""
    probs: list[float]
    num_classes: int


class ClassificationResponse(_ListResponse):
    data: list[ClassificationData]


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_ListResponse):
    data: list[ScoreData]


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    """The document's position in the request."""
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
    """Highest score first, cut to top_n."""
