"""What a chat request (or /tokenize of messages) asks of the chat template, as vLLM's fields say it:
``chat_template`` (needs --trust-request-chat-template), ``chat_template_kwargs``, ``continue_final_message`` and
``reasoning_effort``; and ``echo``, the last message put back in front of the reply."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from pagedllm.engine.processor import check_template_kwargs
from pagedllm.errors import ValidationError

#: Most bytes of a request's own chat template, and of its chat_template_kwargs as JSON.
MAX_TEMPLATE_BYTES = 64 * 1024


@dataclass
class TemplateOptions:
    """How one request's conversation is rendered."""

    chat_template: str | None = None
    """The request's own template (None: the server's --chat-template or the model's)."""
    continue_final_message: bool = False
    """End inside the last message: the model goes on with it."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """More variables the template sees (enable_thinking, reasoning_effort...)."""


def template_options(req: Any, trust_request_chat_template: bool) -> TemplateOptions:
    """The checked template options of a ChatCompletionRequest or TokenizeRequest (400 naming the field: a request
    template without --trust-request-chat-template, continue_final_message with add_generation_prompt, a reserved
    or oversized chat_template_kwargs)."""
    template = getattr(req, "chat_template", None)
    if template is not None:
        if not trust_request_chat_template:
            raise ValidationError("chat_template in a request is refused: this server does not run templates its "
                                  "clients send (start it with --trust-request-chat-template to allow them)",
                                  param="chat_template")
        if len(template.encode()) > MAX_TEMPLATE_BYTES:
            raise ValidationError(f"chat_template is over {MAX_TEMPLATE_BYTES} bytes", param="chat_template")
    continue_final = bool(getattr(req, "continue_final_message", False))
    if continue_final and req.add_generation_prompt:
        raise ValidationError("continue_final_message and add_generation_prompt cannot both be true (add_generation_"
                              "prompt defaults to true: set it to false to continue the last message)",
                              param="continue_final_message", value=True)
    kwargs = check_template_kwargs(req.chat_template_kwargs)
    if kwargs and len(json.dumps(kwargs).encode()) > MAX_TEMPLATE_BYTES:
        raise ValidationError(f"chat_template_kwargs is over {MAX_TEMPLATE_BYTES} bytes of JSON",
                              param="chat_template_kwargs")
    effort = getattr(req, "reasoning_effort", None)
    if effort is not None:  # as vLLM: the field wins over a kwarg of its name; enable_thinking only if unset
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
    return TemplateOptions(template, continue_final, kwargs)


def echoed_text(messages: list[Any], add_generation_prompt: bool, text_of: Any) -> str:
    """What ``echo`` puts before the reply (vLLM's rule): the last message's text when its role is the reply's
    (the assistant's with add_generation_prompt, else the last message's own: always then), else ""."""
    if not messages:
        return ""
    last = messages[-1]
    role = "assistant" if add_generation_prompt else last.role
    if last.role != role:
        return ""
    return text_of(len(messages) - 1, last) or ""


@lru_cache(maxsize=16)
def template_variables(source: str) -> frozenset[str]:
    """The variables a chat template reads from its context (empty when it does not parse: rendering says why)."""
    import jinja2
    from jinja2 import meta

    try:
        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(source)))
    except jinja2.TemplateError:
        return frozenset()


def check_reasoning_effort(options: TemplateOptions, source: Any, param: str = "reasoning_effort") -> None:
    """A reasoning effort reaches the model only through its template's reasoning_effort or enable_thinking: 400
    naming ``param`` when the template (``source``, its text) reads neither, rather than dropping the effort."""
    effort = options.kwargs.get("reasoning_effort")
    if effort is None or not isinstance(source, str):
        return
    if not template_variables(source) & {"reasoning_effort", "enable_thinking"}:
        raise ValidationError(f"{param} {effort!r} cannot be honoured: this model's chat template reads neither "
                              "reasoning_effort nor enable_thinking", param=param, value=effort)
