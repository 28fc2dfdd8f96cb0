"""One choice of a streamed chat reply, as the chat route sends it: the engine's new text in, a chat delta out.

Used by /v1/chat/completions' own stream, by /inference/v1/generate's streamed output_mode "derender" and by the
streamed /v1/chat/completions/derender, so the three send the same deltas for the same tokens: the reply split into
reasoning and content by the request's reasoning parser; with tool calling on, the reply held to its end and sent
whole with its calls (they are known only then; finish_reason "tool_calls" when it called one).
"""
from __future__ import annotations

from typing import Any, Protocol

from pagedllm.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    ToolCall,
)
from pagedllm.outputs import CompletionOutput


class ChatFormatter(Protocol):
    """What of the chat route the deltas use (OpenAIServingChat; a protocol: the route imports this module)."""

    def message_of(self, text: str, finish_reason: str | None, tools: Any, reasoning: Any = None
                   ) -> tuple[ChatResponseMessage, str | None]: ...

    def logprobs_of(self, c: CompletionOutput, top_n: int | None, as_ids: bool = False) -> ChatLogprobs | None: ...


class ChatRunView(Protocol):
    """What of a request's ChatRun (serving_chat.py) the deltas read."""

    tools: Any
    reasoning: Any
    logprobs: int | None
    as_ids: bool


class ChoiceDeltas:
    """The deltas of one choice. ``hold_ids``: with tool calling, its token ids go with the whole reply at the end
    (the chat route's own stream); else each delta carries its own, and a held one is sent as an empty delta (the
    derender routes: a client maps each generate chunk to one delta)."""

    def __init__(self, chat: ChatFormatter, run: ChatRunView, hold_ids: bool) -> None:
        self.chat, self.run, self.hold_ids = chat, run, hold_ids
        self.text = ""
        """The reply so far (tool calling sends it whole)."""
        self.held: list[int] = []
        self.reasoning = None if run.reasoning is None else run.reasoning.stream()

    def resume(self, text: str) -> None:
        """Carry on after ``text`` was sent (a streamed derender's earlier calls)."""
        self.text = text
        if self.reasoning is not None:
            self.reasoning.resume(text)

    def next(self, c: CompletionOutput, ids: bool) -> ChatStreamChoice | None:
        """The delta of ``c`` (its new text, tokens and logprobs); None: nothing to send yet (tool calling with
        ``hold_ids``). ``ids``: return_token_ids."""
        if not self.run.tools.active:
            return self._delta(c, ids)
        self.text += c.text
        if self.hold_ids:
            self.held.extend(c.token_ids)
        shown = (list(self.held) if self.hold_ids else list(c.token_ids)) if ids else None
        if c.finish_reason is not None:
            return self._whole(c, shown)
        if self.hold_ids:
            return None
        return ChatStreamChoice(index=c.index, delta=DeltaMessage(), token_ids=shown,
                                logprobs=self.chat.logprobs_of(c, self.run.logprobs, self.run.as_ids))

    def _delta(self, c: CompletionOutput, ids: bool) -> ChatStreamChoice:
        """The new text as a delta (split into reasoning and content by the reasoning parser, if any)."""
        if self.reasoning is None:
            delta = DeltaMessage(content=c.text)
        else:
            piece = self.reasoning.delta(c.text, c.finish_reason is not None)
            delta = DeltaMessage(content=piece.content, reasoning_content=piece.reasoning)
        return ChatStreamChoice(index=c.index, delta=delta,
                                logprobs=self.chat.logprobs_of(c, self.run.logprobs, self.run.as_ids),
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                token_ids=list(c.token_ids) if ids else None)

    def _whole(self, c: CompletionOutput, token_ids: list[int] | None) -> ChatStreamChoice:
        """The finished reply at once, its tool calls parsed."""
        message, finish = self.chat.message_of(self.text, c.finish_reason, self.run.tools, self.run.reasoning)
        calls = [ToolCall(index=i, **call.model_dump(exclude={"index"})) for i, call in enumerate(message.tool_calls)]
        logprobs = None if self.hold_ids else self.chat.logprobs_of(c, self.run.logprobs, self.run.as_ids)
        return ChatStreamChoice(index=c.index, delta=DeltaMessage(
            content=message.content, reasoning_content=message.reasoning_content, tool_calls=calls or None),
            logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason, token_ids=token_ids)
