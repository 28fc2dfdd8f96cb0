"""Reasoning parsers (``--reasoning-parser``): a reasoning model's ``<think>…</think>`` goes to
``reasoning_content``, the rest to ``content``, as vLLM does.

- ``deepseek_r1``: the chat template opens ``<think>`` itself, so the reply starts inside the
  reasoning (a leading ``<think>`` is dropped too); everything up to ``</think>`` is reasoning,
  and a reply that never closes it is all reasoning.
- ``qwen3``: reasoning only between ``<think>`` and ``</think>``; a reply without ``<think>`` is
  all content (Qwen3 with thinking turned off).

Streaming: each delta is split the same way, holding back a possible partial tag at the end of
the text seen so far until the next delta shows what it is.
"""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass
class ReasoningSplit:
    reasoning: str | None
    content: str | None


class ReasoningParser:
    """Splits one reply (whole, or delta by delta through ``stream``)."""

    name = ""
    start, end = START, END
    """The markers around the reasoning (thinking_token_budget forces ``end``)."""
    starts_inside = False
    """The reply begins inside the reasoning (the template opened <think>)."""

    def split(self, text: str, finished: bool = True) -> ReasoningSplit:
        """Reasoning and content of ``text``. Not ``finished``: a tag still being written is left out."""
        if not finished:
            text = _without_partial_tag(text)
        body = text
        if text.lstrip().startswith(START):
            body = text.lstrip()[len(START):]
        elif not self.starts_inside:
            return ReasoningSplit(None, text or None)
        if END not in body:
            return ReasoningSplit(body or None, None)
        reasoning, _, content = body.partition(END)
        return ReasoningSplit(reasoning or None, content.lstrip("\n") or None)

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


class ReasoningStream:
    """One streamed reply: ``delta(new_text, finished)`` -> the new reasoning and content pieces."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = ReasoningSplit("", "")

    def delta(self, new_text: str, finished: bool) -> ReasoningSplit:
        self.text += new_text
        now = self.parser.split(self.text, finished)
        pieces = []
        for field in ("reasoning", "content"):
            full, sent = getattr(now, field) or "", getattr(self.sent, field) or ""
            pieces.append(full[len(sent):] if full.startswith(sent) else full)
            setattr(self.sent, field, full)
        return ReasoningSplit(pieces[0] or None, pieces[1] or None)


def _without_partial_tag(text: str) -> str:
    """``text`` without a trailing prefix of <think> or </think> (it may be a tag being written)."""
    for tag in (END, START):
        for n in range(len(tag) - 1, 0, -1):
            if text.endswith(tag[:n]):
                return text[:-n]
    return text


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser named ``name`` (None: no parsing); an unknown name is a ValueError listing them."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {sorted(PARSERS)}")
    return PARSERS[name]()
