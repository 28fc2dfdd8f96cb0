"""Reading LoRA adapters in PEFT's format: adapter_config.json and adapter_model.safetensors.

PEFT names each matrix after the base model's module (``base_model.model.model.layers.3.
self_attn.q_proj.lora_A.weight``: A is (rank, in), B is (out, rank)); the delta of a module is
``scaling * B @ A`` with scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). Our
models pack q/k/v and gate/up into one matmul each: an adapter's q_proj matrices land in the
q rows of qkv_proj (the model's ``packed_modules_mapping`` says which); an adapter of the packed
layer itself (Phi-3's checkpoints have qkv_proj / gate_up_proj) shares its A between the parts and
splits its B by their rows.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors import SafetensorError

from pagedllm.errors import ValidationError, quoted
from pagedllm.lora_request import ADAPTER_CONFIG_FILE, LoRARequest

CONFIG_FILE = ADAPTER_CONFIG_FILE
MAX_CONFIG_BYTES = 1 << 20
"""A larger adapter_config.json is refused unread (PEFT writes a few kB)."""
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRATarget:
    """One of the model's linear layers an adapter may change: its input width and, per packed
    projection (q, k, v / gate, up / the layer itself), the checkpoint name and output rows."""

    in_features: int
    parts: tuple[tuple[str, int], ...]
    """(checkpoint module name, output rows) per projection, in the packed layer's row order."""


@dataclass
class LoRAWeights:
    """An adapter read into host memory: per target layer, per projection, (A (rank, in), B * scaling
    (out, rank)) or None where the adapter leaves that projection alone."""

    lora_request: LoRARequest
    rank: int
    layers: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]


def _refuse(lora: LoRARequest, reason: str) -> ValidationError:
    """The one error for an adapter folder we cannot run. ``reason`` is a class of fault written by us (a file
    missing, a field out of range): it never quotes what the folder holds, because a server client may name any
    folder the server can read (values, tensor names, shapes and parse errors would leak its contents)."""
    return ValidationError(f"LoRA adapter {lora.lora_name!r} at {lora.lora_path!r} is not a valid LoRA adapter "
                           f"folder for this model ({reason})", param="lora_request", value=lora.lora_name)


def _read_json(lora: LoRARequest, path: str) -> dict:
    """adapter_config.json as a dict (size-capped; refused without quoting it when it cannot be read)."""
    try:
        if os.path.getsize(path) > MAX_CONFIG_BYTES:
            raise _refuse(lora, f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
        with open(path, "rb") as f:
            config = json.loads(f.read().decode("utf-8"))
    except OSError:
        raise _refuse(lora, f"{CONFIG_FILE} cannot be read") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # their messages quote the file's bytes
        raise _refuse(lora, f"{CONFIG_FILE} is not valid JSON") from None
    if not isinstance(config, dict):
        raise _refuse(lora, f"{CONFIG_FILE} is not a JSON object")
    return config


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_RESIDUAL_INITS = ("pissa", "olora", "corda", "loftq")
"""init_lora_weights values whose training starts from a changed base model (the principal part moved into the
adapter, or the base quantized): run over the original base, such an adapter gives wrong outputs, silently."""


def read_config(lora: LoRARequest, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from adapter_config.json, refusing what we cannot run exactly."""
    path = os.path.join(lora.lora_path, CONFIG_FILE)
    if not os.path.isfile(path):
        raise _refuse(lora, f"no {CONFIG_FILE} (a PEFT adapter folder is needed)")
    if not os.path.isfile(os.path.join(lora.lora_path, WEIGHTS_FILE)):
        raise _refuse(lora, f"no {WEIGHTS_FILE} (only safetensors weights are read)")
    config = _read_json(lora, path)
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(lora, "peft_type is not LORA")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise _refuse(lora, "r must be a positive integer")
    if rank > max_rank:
        raise _refuse(lora, f"its rank is above max_lora_rank={max_rank}")
    if not _is_number(alpha):
        raise _refuse(lora, "lora_alpha must be a finite number")
    unsupported = {"bias": config.get("bias", "none") != "none", "use_dora": bool(config.get("use_dora")),
                   "modules_to_save": bool(config.get("modules_to_save")),
                   "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
                   "rank_pattern": bool(config.get("rank_pattern")), "alpha_pattern": bool(config.get("alpha_pattern"))}
    if any(unsupported.values()):
        raise _refuse(lora, f"{[k for k, v in unsupported.items() if v]} are not supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_RESIDUAL_INITS):
        raise _refuse(lora, f"init_lora_weights {quoted(init)} was trained over a base model whose weights it changed "
                            "(not the one served here); save it with peft's path_initial_model_for_weight_conversion "
                            "to get a plain LoRA")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return rank, scaling


def load_adapter(lora: LoRARequest, targets: dict[str, LoRATarget], max_rank: int) -> LoRAWeights:
    """Read and check an adapter against the model's LoRA targets (names, shapes, rank)."""
    from safetensors.torch import load_file

    rank, scaling = read_config(lora, max_rank)
    part_of: dict[str, tuple[str, int]] = {}  # checkpoint module name -> (target layer, projection index)
    for name, target in targets.items():
        for index, (part, _) in enumerate(target.parts):
            part_of[part] = (name, index)
    try:
        tensors = load_file(os.path.join(lora.lora_path, WEIGHTS_FILE))
    except (OSError, SafetensorError):  # its message may quote the header
        raise _refuse(lora, f"{WEIGHTS_FILE} is not a readable safetensors file") from None
    found: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    fused: dict[str, dict[str, torch.Tensor]] = {}  # adapters of a packed layer as one module (Phi-3's qkv_proj)
    for key, tensor in tensors.items():
        stem = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        module, _, kind = stem.rpartition(".lora_")
        if kind in ("A.weight", "B.weight") and module in part_of:
            found.setdefault(part_of[module], {})[kind[0]] = tensor
        elif kind in ("A.weight", "B.weight") and module in targets and len(targets[module].parts) > 1:
            fused.setdefault(module, {})[kind[0]] = tensor
        else:
            names = sorted({n.rsplit(".", 1)[-1] for n in [*part_of, *targets]})
            raise _refuse(lora, f"a tensor changes no module we can adapt (supported: the linear layers {names})")
    for name, pair in fused.items():  # one A for every projection, B split by their rows
        if any(key[0] == name for key in found):
            raise _refuse(lora, f"{name} is adapted both whole and by its projections")
        a, b = pair.get("A"), pair.get("B")
        rows = [r for _, r in targets[name].parts]
        if a is None or b is None or b.dim() != 2 or b.shape[0] != sum(rows):
            raise _refuse(lora, f"{name}: lora_A / lora_B missing or lora_B not {sum(rows)} rows")
        for index, piece in enumerate(b.split(rows, dim=0)):
            found[(name, index)] = {"A": a, "B": piece}
    if not found:
        raise _refuse(lora, f"{WEIGHTS_FILE} holds no LoRA matrices")
    layers: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}
    for (name, index), pair in found.items():
        target = targets[name]
        part, rows = target.parts[index]
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise _refuse(lora, f"{part} has only one of lora_A and lora_B")
        if tuple(a.shape) != (rank, target.in_features) or tuple(b.shape) != (rows, rank):
            raise _refuse(lora, f"{part}: the shapes of lora_A / lora_B do not fit the model and r "
                                f"(lora_B needs {rows} rows, lora_A {target.in_features} columns)")
        a, b = a.float(), b.float() * scaling
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):  # would turn every output it adapts to NaN
            raise _refuse(lora, f"{part}: lora_A or lora_B (times lora_alpha / r) holds NaN or infinite values")
        layers.setdefault(name, [None] * len(target.parts))[index] = (a, b)
    return LoRAWeights(lora, rank, layers)
