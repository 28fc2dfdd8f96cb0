"""What the APIs mapped onto chat completions (Responses, Anthropic Messages) share: building the chat request
they become, checking their items' keys, and naming their own fields in errors from the chat path."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError as PydanticValidationError

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.errors import QUOTE_CHARS, ValidationError


def chat_request(fields: dict[str, Any], names: dict[str, str]) -> ChatCompletionRequest:
    """The chat completion request of ``fields``; an error names the client's field (``names``: chat's -> it)."""
    try:
        return ChatCompletionRequest(**fields)
    except PydanticValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise renamed(ValidationError(f"{where}: {first.get('msg')}", param=where), names) from None


def renamed(error: ValidationError, names: dict[str, str]) -> ValidationError:
    """``error`` with its param's first part (a chat field) renamed to the client's field, message included."""
    if error.param is None:
        return error
    base = error.param.split(".")[0].split("[")[0]
    name = names.get(base)
    if name is None:
        return error
    message = error.message.replace(base, name, 1) if error.message.startswith(base) else error.message
    return ValidationError(message, param=name + error.param[len(base):], value=error.value)


def check_keys(item: dict, keys: set[str], where: str) -> None:
    """400 naming the first key of ``item`` outside ``keys``, never silently ignored (a null one is as good as
    absent)."""
    unknown = sorted(k for k, v in item.items() if k not in keys and v is not None)
    if unknown:
        name = f"{where}.{unknown[0][:QUOTE_CHARS]}"  # a key is the client's: a 1 MB one is not echoed whole
        raise ValidationError(f"{name} is not supported by this server", param=name)


def format_field(outer: dict | None, where: str, refused: str) -> Any:
    """``outer["format"]`` of an object that holds a format and one setting we cannot honour (``refused``: a 400
    naming it unless null); None when either is absent."""
    if outer is None:
        return None
    check_keys(outer, {"format", refused}, where)
    if outer.get(refused) is not None:
        raise ValidationError(f"{where}.{refused} is not supported by this server", param=f"{where}.{refused}")
    return outer.get("format")


def string_field(item: dict, key: str, where: str) -> str:
    """``item[key]``, which must be a string (400 naming ``where.key``)."""
    value = item.get(key)
    if not isinstance(value, str):
        raise ValidationError.bad_value(f"{where}.{key}", value, "a string")
    return value
