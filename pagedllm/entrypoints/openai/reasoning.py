"""Reasoning parsers (``--reasoning-parser``): a reasoning model's ``<think>…</think>`` goes to
``reasoning_content``, the rest to ``content``, as vLLM does.

- ``deepseek_r1``: the chat template opens ``<think>`` itself, so the reply starts inside the
  reasoning (a leading ``<think>`` is dropped too); everything up to ``</think>`` is reasoning,
  and a reply that never closes it is all reasoning.
- ``qwen3``: as vLLM 0.34's, the reply starts inside the reasoning (Qwen3's template may or may not
  write ``<think>`` in the prompt; a leading one is dropped) up to ``</think>``, or up to a
  ``<tool_call>`` (a call out of the reasoning ends it; the call is content); a reply that
  closes neither is all reasoning. With thinking off (``chat_template_kwargs``'
  ``enable_thinking`` false) the whole reply is content; a prompt whose last turn already closed
  the reasoning (``</think>`` after its last ``<|im_start|>``/``<|im_end|>``) starts it in content.

A grammar (``response_format``, ``structured_outputs``, a forced tool call) on a reply that starts inside the
reasoning holds only what follows it, as vLLM's: the engine applies it from the token after ``</think>``
(SamplingParams.grammar_after_reasoning); a reply that starts in content is held from its first token.

Streaming: each delta is split the same way, holding back a possible partial tag at the end of
the text seen so far until the next delta shows what it is.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

START, END = "<think>", "</think>"
TOOL_CALL = "<tool_call>"
TURN_MARKERS = ("<|im_start|>", "<|im_end|>")


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
    thinking = True
    """False: the request turned thinking off; the whole reply is content."""
    ends_at: tuple[str, ...] = ()
    """Markers besides ``end`` that end the reasoning and begin the content, which keeps them."""

    def for_request(self, template_kwargs: dict[str, Any], prompt: str) -> ReasoningParser:
        """This parser for one request: its chat template variables and its rendered prompt. The server's parser is
        shared: one that changes returns a copy."""
        return self

    @property
    def reasons_first(self) -> bool:
        """The reply starts inside the reasoning (a grammar then holds only what follows its end)."""
        return self.thinking and self.starts_inside

    def split(self, text: str, finished: bool = True) -> ReasoningSplit:
        """Reasoning and content of ``text``. Not ``finished``: a tag still being written is left out."""
        if not self.thinking:
            return ReasoningSplit(None, text or None)
        if not finished:
            text = _without_partial_tag(text, (END, START, *self.ends_at))
        body = text
        if text.lstrip().startswith(START):
            body = text.lstrip()[len(START):]
        elif not self.starts_inside:
            return ReasoningSplit(None, text or None)
        cut, marker = min(((body.find(m), m) for m in (END, *self.ends_at) if m in body), default=(-1, END))
        if cut < 0:
            return ReasoningSplit(body or None, None)
        reasoning = body[:cut]
        content = body[cut + len(marker):].lstrip("\n") if marker == END else body[cut:]
        return ReasoningSplit(reasoning or None, content or None)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_inside = True
    ends_at = (TOOL_CALL,)

    def for_request(self, template_kwargs: dict[str, Any], prompt: str) -> ReasoningParser:
        """As vLLM 0.34's qwen3 parser: ``enable_thinking`` false (any false value) makes the reply all content; a
        prompt whose last turn closed the reasoning starts it in content (a grammar does not: as vLLM, it holds
        the reply after its reasoning)."""
        thinking = bool(template_kwargs.get("enable_thinking", True))
        turn = prompt[max(prompt.rfind(m) for m in TURN_MARKERS):] if any(m in prompt for m in TURN_MARKERS) \
            else prompt
        closed = turn.rfind(END) > turn.rfind(START)
        if thinking and not closed:
            return self
        parser = copy.copy(self)
        parser.thinking, parser.starts_inside = thinking, False
        return parser


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


class ReasoningStream:
    """One streamed reply: ``delta(new_text, finished)`` -> the new reasoning and content pieces."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = ReasoningSplit("", "")

    def resume(self, text: str) -> None:
        """Carry on after ``text`` was sent (a streamed derender's earlier calls): what a stream fed it piece by
        piece would hold, since a split depends only on the text so far."""
        self.text = text
        now = self.parser.split(text, False)
        self.sent = ReasoningSplit(now.reasoning or "", now.content or "")

    def delta(self, new_text: str, finished: bool) -> ReasoningSplit:
        self.text += new_text
        now = self.parser.split(self.text, finished)
        pieces = []
        for field in ("reasoning", "content"):
            full, sent = getattr(now, field) or "", getattr(self.sent, field) or ""
            pieces.append(full[len(sent):] if full.startswith(sent) else full)
            setattr(self.sent, field, full)
        return ReasoningSplit(pieces[0] or None, pieces[1] or None)


def _without_partial_tag(text: str, tags: tuple[str, ...] = (END, START)) -> str:
    """``text`` without a trailing prefix of one of ``tags`` (it may be a tag being written)."""
    for tag in tags:
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


@dataclass
class ReasoningConfig:
    """vLLM's ``--reasoning-config`` JSON: the strings thinking_token_budget works with. ``reasoning_start_str``
    opens a reasoning section (default: the parser's ``<think>``); ``reasoning_end_str`` is what a spent budget
    forces (default: the parser's ``</think>``; it may lead up to it with a phrase, e.g. "\\nTime to answer.
    </think>"). The section still ends where the parser's own end marker (or, without a parser, this string)
    is written."""

    reasoning_start_str: str = ""
    reasoning_end_str: str = ""
    reasoning_parser: str = ""
    """vLLM fills it from --reasoning-parser; given here, it must name that parser (check_parser)."""

    def check_parser(self, parser: str | None) -> None:
        """ValueError when this config's ``reasoning_parser`` is not --reasoning-parser's (vLLM would use the
        flag's)."""
        if self.reasoning_parser and self.reasoning_parser != (parser or ""):
            raise ValueError(f"--reasoning-config's reasoning_parser {self.reasoning_parser!r} is not "
                             f"--reasoning-parser's {parser!r}: name the parser with --reasoning-parser")

    def markers(self, parser: ReasoningParser | None) -> tuple[str, str, str] | None:
        """(start, forced end, natural end) strings, or None when neither this nor a parser names both ends."""
        start = self.reasoning_start_str or (parser.start if parser is not None else "")
        forced = self.reasoning_end_str or (parser.end if parser is not None else "")
        if not start or not forced:
            return None
        return start, forced, parser.end if parser is not None else forced


def parse_reasoning_config(value: str) -> ReasoningConfig:
    """``--reasoning-config``'s JSON object (vLLM's keys; ``reasoning_parser`` may repeat --reasoning-parser's
    name, as vLLM fills it from that flag); anything else is a ValueError naming it."""
    import json

    try:
        data = json.loads(value)
    except ValueError as e:
        raise ValueError(f"--reasoning-config must be a JSON object: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--reasoning-config must be a JSON object, got {type(data).__name__}")
    known = {"reasoning_start_str", "reasoning_end_str", "reasoning_parser"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"--reasoning-config has no key {', '.join(map(repr, unknown))}; known: {sorted(known)}")
    for key, item in data.items():
        if not isinstance(item, str):
            raise ValueError(f"--reasoning-config's {key} must be a string, got {item!r}")
    return ReasoningConfig(**data)
