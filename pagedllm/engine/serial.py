"""The messages between a front end and an engine core process, as bytes: msgpack, no pickle.

A message is one of engine/messages.py's records; it and its fields are plain data (None, bool, int,
float, str, bytes, lists, dicts) or the dataclasses and enums listed here, each sent as an extension
(class name, field values by name). Decoding can only ever build these types, so a message cannot run
code; a type not listed fails to encode, loudly.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgpack

from pagedllm import config, outputs
from pagedllm.engine import messages
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.lifecycle import CollectiveRPCError, EnginePausedError
from pagedllm.engine.messages import EngineStats
from pagedllm.errors import ValidationError
from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.prompt_embeds import PromptEmbeds
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

_DATACLASS = 1
_ENUM = 2

_DATACLASSES: dict[str, type] = {cls.__name__: cls for cls in (
    SamplingParams, StructuredOutputsParams, BeamSearchParams, LoRARequest, EngineStats, EngineArgs,
    PoolingParams, config.PoolerConfig, PromptEmbeds,
    config.EngineConfig, config.ModelConfig, config.CacheConfig, config.SchedulerConfig, config.ParallelConfig,
    config.DeviceConfig, config.LoRAConfig, config.StructuredOutputsConfig, config.SpeculativeConfig,
    config.WatermarkConfig,
    outputs.EngineCoreOutput,
    outputs.TokenLogprobs, outputs.RequestOutput, outputs.CompletionOutput, outputs.RequestMetrics, outputs.Logprob,
    *messages.MESSAGE_TYPES)}
_ENUMS: dict[str, type[enum.Enum]] = {cls.__name__: cls for cls in (RequestOutputKind,)}


def _default(obj: Any) -> msgpack.ExtType:
    name = type(obj).__name__
    if isinstance(obj, enum.Enum) and _ENUMS.get(name) is type(obj):
        return msgpack.ExtType(_ENUM, encode([name, obj.value]))
    if dataclasses.is_dataclass(obj) and _DATACLASSES.get(name) is type(obj):
        return msgpack.ExtType(_DATACLASS, encode([name, {f.name: getattr(obj, f.name)
                                                          for f in dataclasses.fields(obj)}]))
    if isinstance(obj, tuple):
        return list(obj)
    if type(obj) is int:  # msgpack asks here for what does not fit in 64 bits
        raise OverflowError(f"the integer {obj} does not fit in 64 bits")
    raise TypeError(f"{name} cannot cross to the engine core process (not a plain value or a listed type)")


def _ext_hook(code: int, data: bytes) -> Any:
    name, value = decode(data)
    if code == _ENUM:
        return _ENUMS[name](value)
    assert code == _DATACLASS, code
    cls = _DATACLASSES[name]
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    obj = cls(**{k: v for k, v in value.items() if k in init})
    for k, v in value.items():  # fields set after __init__ (none are today): as they were sent
        if k not in init:
            object.__setattr__(obj, k, v)
    return obj


def encode(message: Any) -> bytes:
    """One message as bytes (TypeError naming the first type that is not allowed)."""
    return msgpack.packb(message, default=_default, strict_types=True, use_bin_type=True)


def decode(data: bytes) -> Any:
    """The message ``encode`` made (tuples come back as lists; int dict keys stay ints)."""
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def encode_error(error: BaseException) -> messages.CoreError:
    """An exception as plain data: its type's name, message, and a ValidationError's param and value."""
    if isinstance(error, ValidationError):
        value = error.value
        try:
            encode(value)
        except (TypeError, ValueError, OverflowError):
            value = repr(value)
        return messages.CoreError(type="ValidationError", message=error.message, param=error.param, value=value)
    return messages.CoreError(type=type(error).__name__, message=str(error) or type(error).__name__)


_PASSED_ERRORS: dict[str, type[Exception]] = {cls.__name__: cls for cls in (EnginePausedError, CollectiveRPCError)}


def decode_error(error: messages.CoreError) -> Exception:
    """A ValidationError as it was raised; anything else as a RuntimeError naming the original type."""
    if error.type == "ValidationError":
        return ValidationError(error.message, error.param, error.value)
    if error.type in _PASSED_ERRORS:  # errors the front answers in their own way (503, 500 naming the cause)
        return _PASSED_ERRORS[error.type](error.message)
    return RuntimeError(f"{error.type} in the engine core: {error.message}")
