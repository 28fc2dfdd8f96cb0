"""``pagedllm chat`` and ``pagedllm complete``: vLLM's command-line clients of a running server (``vllm chat``,
``vllm complete``), through the openai SDK: the same flags (``--url``, ``--model-name``, ``--api-key``,
``-q/--quick``, ``--stats``; chat's ``--system-prompt``, complete's ``--max-tokens``), replies streamed to
stdout, reasoning between ``<think>`` lines."""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable
from typing import Any

from pagedllm import envs
from pagedllm.entrypoints.cli_args import SubParsers

DEFAULT_URL = "http://localhost:8000/v1"
"""Where `pagedllm serve` answers by default (vLLM's default too)."""


def _add_query_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL,
                        help=f"the server's OpenAI-compatible base URL (default: {DEFAULT_URL})")
    parser.add_argument("--model-name", default=None,
                        help="the model to ask (default: the first one the server's /v1/models lists)")
    parser.add_argument("--api-key", default=None,
                        help="the server's API key (default: OPENAI_API_KEY, else none)")
    parser.add_argument("--stats", action="store_true",
                        help="after each reply, print its time to first token and tokens per second")


def add_parsers(sub: SubParsers) -> None:
    """The ``chat`` and ``complete`` commands."""
    chat = sub.add_parser("chat", help="chat with a running server (vLLM's `vllm chat`)",
                          description="Chat with a running pagedllm (or any OpenAI-compatible) server: one message "
                                      "a line, the conversation kept; Ctrl-D ends it.")
    _add_query_options(chat)
    chat.add_argument("--system-prompt", default=None, help="a system message opening the conversation")
    chat.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                      help="send MESSAGE alone, print the reply and exit")
    chat.set_defaults(func=run_chat)
    complete = sub.add_parser("complete", help="complete prompts on a running server (vLLM's `vllm complete`)",
                              description="Complete prompts (one a line) on a running pagedllm (or any "
                                          "OpenAI-compatible) server; Ctrl-D ends it.")
    _add_query_options(complete)
    complete.add_argument("--max-tokens", type=int, default=None, help="most tokens generated per completion")
    complete.add_argument("-q", "--quick", default=None, metavar="PROMPT",
                          help="complete PROMPT alone, print it and exit")
    complete.set_defaults(func=run_complete)


def _connect(ns: argparse.Namespace) -> tuple[Any, str]:
    """(an OpenAI client of ``--url``, the model to ask)."""
    import openai

    client = openai.OpenAI(base_url=ns.url, api_key=ns.api_key or envs.OPENAI_API_KEY.read() or "EMPTY")
    model = ns.model_name or client.models.list().data[0].id
    print(f"Using model: {model}", flush=True)
    return client, model


class _Timer:
    """Time to first token and tokens per second of one streamed reply (--stats)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.tokens = 0

    def seen(self) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.start

    def report(self) -> None:
        total = time.perf_counter() - self.start
        if self.first is None or total <= 0:
            return
        print(f"TTFT: {self.first * 1000:.2f} ms")
        print(f"TPS:  {self.tokens / total:.2f} tokens/s ({self.tokens} tokens in {total:.2f}s)")


def print_chat_stream(chunks: Iterable[Any], stats: bool = False) -> str:
    """Print a streamed chat reply as it comes (reasoning between <think> lines); returns its content."""
    timer, content, thinking = _Timer(), "", False
    for chunk in chunks:
        if chunk.usage is not None:
            timer.tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning = getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)
        if reasoning:
            timer.seen()
            if not thinking:
                print("<think>", flush=True)
                thinking = True
            print(reasoning, end="", flush=True)
        if delta.content:
            timer.seen()
            if thinking:
                print("\n</think>", flush=True)
                thinking = False
            content += delta.content
            print(delta.content, end="", flush=True)
    print("\n</think>" if thinking else "", flush=True)
    if stats:
        timer.report()
    return content


def print_completion_stream(chunks: Iterable[Any], stats: bool = False) -> str:
    """Print a streamed completion as it comes; returns its text."""
    timer, text = _Timer(), ""
    for chunk in chunks:
        if chunk.usage is not None:
            timer.tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            timer.seen()
            text += chunk.choices[0].text
            print(chunk.choices[0].text, end="", flush=True)
    print(flush=True)
    if stats:
        timer.report()
    return text


def _lines(prompt_line: str) -> Iterable[str]:
    """What the user types, a line at a time, until end of input (Ctrl-D) or Ctrl-C."""
    print(prompt_line)
    while True:
        try:
            yield input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return


def _guarded(run: Any, ns: argparse.Namespace) -> int:
    """Run a client command; the server's error (or an unreachable server) is one line on stderr, status 1."""
    import openai

    try:
        run(ns)
    except openai.APIStatusError as e:
        print(f"error: the server answered {e.status_code}: {e.message}", file=sys.stderr)
        return 1
    except openai.APIConnectionError as e:
        print(f"error: cannot reach {ns.url}: {e}", file=sys.stderr)
        return 1
    return 0


def run_chat(ns: argparse.Namespace) -> int:
    """`pagedllm chat`: a conversation with the server, streamed (or one message with -q)."""

    def chat(ns: argparse.Namespace) -> None:
        client, model = _connect(ns)
        conversation: list[dict[str, str]] = []
        if ns.system_prompt is not None:
            conversation.append({"role": "system", "content": ns.system_prompt})
        options: dict[str, Any] = {"model": model, "stream": True}
        if ns.stats:
            options["stream_options"] = {"include_usage": True}
        messages = [ns.quick] if ns.quick is not None else _lines("Please enter a message for the chat model:")
        for message in messages:
            conversation.append({"role": "user", "content": message})
            reply = print_chat_stream(client.chat.completions.create(messages=conversation, **options), ns.stats)
            conversation.append({"role": "assistant", "content": reply})

    return _guarded(chat, ns)


def run_complete(ns: argparse.Namespace) -> int:
    """`pagedllm complete`: each prompt's completion, streamed (or one prompt with -q)."""

    def complete(ns: argparse.Namespace) -> None:
        client, model = _connect(ns)
        options: dict[str, Any] = {"model": model, "stream": True}
        if ns.max_tokens is not None:
            options["max_tokens"] = ns.max_tokens
        if ns.stats:
            options["stream_options"] = {"include_usage": True}
        prompts = [ns.quick] if ns.quick is not None else _lines("Please enter prompt to complete:")
        for prompt in prompts:
            print_completion_stream(client.completions.create(prompt=prompt, **options), ns.stats)

    return _guarded(complete, ns)
