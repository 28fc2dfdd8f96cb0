"""A client's prompt embeddings (a tensor, or the base64 of a ``torch.save``d one, as vLLM's ``prompt_embeds``) as
pagedllm.prompt_embeds.PromptEmbeds: every size bounded before anything the payload names is allocated, and every
refusal a ValidationError naming the field."""
from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import torch

from pagedllm.errors import ValidationError
from pagedllm.prompt_embeds import DTYPES, PromptEmbeds

_REASON_CHARS = 200
"""How much of torch's reason for refusing a payload is repeated to the client (it is built from the client's
bytes)."""


def prompt_embeds_from_tensor(tensor: Any, max_tokens: int, hidden_size: int | None = None,
                              param: str = "prompt_embeds") -> PromptEmbeds:
    """A client's tensor, checked (ValidationError naming ``param``): dense or sparse, (num_tokens, hidden) or
    (1, num_tokens, hidden), a floating dtype of DTYPES, 1 <= num_tokens <= ``max_tokens``, hidden == ``hidden_size``
    (the model's; None: any), finite values; the shape is checked before a sparse tensor is made dense."""
    if not isinstance(tensor, torch.Tensor):
        raise ValidationError(f"{param} must be a torch tensor, got {type(tensor).__name__}", param=param)
    shape = tuple(tensor.shape)
    if len(shape) == 3 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 2:
        raise ValidationError(f"{param} must be a 2-D tensor of shape (num_tokens, hidden_size); got shape "
                              f"{tuple(tensor.shape)}", param=param)
    num_tokens, hidden = shape
    if not 1 <= num_tokens <= max_tokens:
        raise ValidationError(f"{param} has {num_tokens} rows (tokens): it must have 1 to {max_tokens} "
                              "(max_model_len)", param=param, value=num_tokens)
    if hidden < 1 or (hidden_size is not None and hidden != hidden_size):
        raise ValidationError(f"{param} has hidden size {hidden}, but this model's is {hidden_size}", param=param,
                              value=hidden)
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValidationError(f"{param} has dtype {name}: it must be one of {list(DTYPES)}", param=param, value=name)
    if tensor.layout != torch.strided:  # the shape is bounded above: so is the dense copy
        tensor = tensor.to_dense()
    tensor = tensor.detach().cpu().reshape(num_tokens, hidden).contiguous()  # (num_tokens, hidden_size)
    if not bool(torch.isfinite(tensor).all()):
        raise ValidationError(f"{param} holds NaN or infinite values", param=param)
    raw = tensor.view(torch.uint8).numpy().tobytes()  # (num_tokens, hidden_size * bytes per value)
    return PromptEmbeds(data=raw, num_tokens=num_tokens, hidden_size=hidden, dtype=name)


def _base64_bytes(payload: str | bytes, param: str) -> bytes:
    """The bytes of a client's base64 text: not empty, valid base64 (else a ValidationError naming ``param``)."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ValidationError(f"{param} is not valid base64 (it is the base64 of a torch.save'd tensor)",
                              param=param) from None
    if not raw:
        raise ValidationError(f"{param} is empty", param=param)
    return raw


def decode_prompt_embeds(payload: str | bytes, max_tokens: int, hidden_size: int | None = None,
                         param: str = "prompt_embeds") -> PromptEmbeds:
    """A client's base64 text of a ``torch.save``d tensor: loaded with ``weights_only=True`` (no code runs) onto the
    CPU, a sparse tensor's invariants checked, then prompt_embeds_from_tensor. Anything else is a ValidationError
    naming ``param``."""
    raw = _base64_bytes(payload, param)
    try:
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # torch has no one error for "not a tensor file": every such error is the payload's
        reason = (str(e).strip() or type(e).__name__)[:_REASON_CHARS]
        raise ValidationError(f"{param} could not be loaded as a torch tensor: {reason}", param=param) from None
    return prompt_embeds_from_tensor(tensor, max_tokens, hidden_size, param)


def encode_prompt_embeds(tensor: torch.Tensor) -> str:
    """A tensor as a client sends it: the base64 text of its ``torch.save`` bytes (tests, examples)."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
