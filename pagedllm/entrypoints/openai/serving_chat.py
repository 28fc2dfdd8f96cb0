"""POST /v1/chat/completions."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from jinja2.exceptions import TemplateError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.openai.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                                  ChatCompletionStreamResponse, ChatLogprobs, ChatMessage,
                                                  ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob,
                                                  DeltaMessage, TopLogprob, UsageInfo, random_id)
from pagedllm.entrypoints.openai.reasoning import ReasoningParser, ReasoningSplit, ReasoningStream
from pagedllm.entrypoints.openai.serving import (SSE_DONE, OpenAIServing, final_outputs, merge_streams, sse,
                                                 unless_disconnected)
from pagedllm.errors import ValidationError
from pagedllm.outputs import CompletionOutput

ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: Any, served_model_names: list[str], reasoning_parser: ReasoningParser | None = None
                 ) -> None:
        super().__init__(engine, served_model_names)
        self.reasoning_parser = reasoning_parser
        """Splits replies into reasoning_content and content (--reasoning-parser); None: all content."""

    def _split(self, text: str) -> ReasoningSplit:
        return ReasoningSplit(None, text) if self.reasoning_parser is None else self.reasoning_parser.split(text)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.check_model(req.model)
        text, prompt_ids = self.apply_chat_template(req.messages, req.add_generation_prompt)
        if req.top_logprobs is not None and not req.logprobs:
            raise ValidationError("top_logprobs needs logprobs=true", param="top_logprobs", value=req.top_logprobs)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens, logprobs, req.stream)
        request_id = random_id("chatcmpl")
        streams = await self.add_all(request_id, [{"prompt_token_ids": prompt_ids, "prompt": text}], params)
        if req.stream:
            return StreamingResponse(self._stream(request_id, model, req, streams), media_type="text/event-stream")
        outputs = await unless_disconnected(final_outputs(streams), raw)
        if outputs is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        out = outputs[0]
        splits = [self._split(c.text) for c in out.outputs]
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=split.content,
                                                                         reasoning_content=split.reasoning),
                              logprobs=self._logprobs(c, logprobs), finish_reason=c.finish_reason,
                              stop_reason=c.stop_reason) for c, split in zip(out.outputs, splits)]
        completion = sum(len(c.token_ids) for c in out.outputs)
        usage = UsageInfo(prompt_tokens=len(prompt_ids), completion_tokens=completion,
                          total_tokens=len(prompt_ids) + completion)
        return JSONResponse(ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                                   usage=usage).model_dump())

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool) -> tuple[str, list[int]]:
        """(prompt text, token ids) of a conversation, through the model's chat template."""
        if not messages:
            raise ValidationError("messages must not be empty", param="messages", value=messages)
        conversation = [{"role": self._role(i, m), "content": self._content(i, m)} for i, m in enumerate(messages)]
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except TemplateError as e:  # the template itself refuses the conversation (e.g. role order)
            raise ValidationError(f"the chat template refused the messages: {e}", param="messages") from e
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def _role(index: int, message: ChatMessage) -> str:
        if message.role not in ROLES:
            raise ValidationError(f"messages[{index}].role must be one of {list(ROLES)}, got {message.role!r}",
                                  param=f"messages[{index}].role", value=message.role)
        return message.role

    @staticmethod
    def _content(index: int, message: ChatMessage) -> str:
        content = message.content
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise ValidationError(f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                                      param=f"messages[{index}].content", value=part.type)
            texts.append(part.text)
        return "".join(texts)

    def _logprobs(self, c: CompletionOutput, top_n: int | None) -> ChatLogprobs | None:
        if c.logprobs is None or top_n is None:
            return None
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs):
            sampled = entry[token_id]
            token = sampled.decoded_token or ""
            top = [TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob,
                              bytes=list((lp.decoded_token or "").encode()))
                   for _, lp in self.top_entries(entry, top_n)]
            content.append(ChatTokenLogprob(token=token, logprob=sampled.logprob, bytes=list(token.encode()),
                                            top_logprobs=top))
        return ChatLogprobs(content=content)

    async def _stream(self, request_id: str, model: str, req: ChatCompletionRequest, streams: list
                      ) -> AsyncIterator[str]:
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        for index in range(req.n):  # the first chunk of each choice names the role
            first = ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            yield sse(ChatCompletionStreamResponse(id=request_id, model=model, choices=[first]))
        prompt_tokens = completion_tokens = 0
        parsers: dict[int, ReasoningStream] = {}
        async for _, out in merge_streams(streams):
            prompt_tokens = len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                if self.reasoning_parser is None:
                    delta = DeltaMessage(content=c.text)
                else:
                    piece = parsers.setdefault(c.index, self.reasoning_parser.stream()).delta(
                        c.text, c.finish_reason is not None)
                    delta = DeltaMessage(content=piece.content, reasoning_content=piece.reasoning)
                choice = ChatStreamChoice(index=c.index, delta=delta,
                                          logprobs=self._logprobs(c, top_n), finish_reason=c.finish_reason,
                                          stop_reason=c.stop_reason)
                yield sse(ChatCompletionStreamResponse(id=request_id, model=model, choices=[choice]))
        if req.stream_options and req.stream_options.include_usage:
            usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                              total_tokens=prompt_tokens + completion_tokens)
            yield sse(ChatCompletionStreamResponse(id=request_id, model=model, choices=[], usage=usage))
        yield SSE_DONE
