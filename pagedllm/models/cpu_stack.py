"""A Llama-family model's decoder layers run as one compiled call per step (csrc/decoder.cpp).

The layers' own forward calls ~10 kernels per layer from Python; with 30 layers and one
sequence, the Python between them cost ~5 ms of a ~17 ms decode step of SmolLM2-135M. The plan
built here holds, once, the pointers those calls would pass (packed weights, norms, biases, KV
caches, rotary tables); each step passes only the step's rows. Same kernels, same order, same
roundings: the results equal the layer-by-layer path bit for bit (tests/models/test_cpu_stack.py).

Used when every piece runs on the compiled kernels: the cpu attention backend, every linear
packed for our GEMM (gate_up with the fused SiLU), kept in a packed GGUF format (csrc/quant.cpp) or, at the
"amx" level, a plain bf16 weight for the AMX GEMM (csrc/gemm_amx.cpp: then only steps of up to 32 rows, the
larger ones' matmuls going to oneDNN layer by layer), no LoRA adapters, one rank, the kernels on; otherwise the
layers run one by one. ``PAGEDLLM_CPU_STACK=0`` turns it off (A/B measurements).
"""
from __future__ import annotations

import ctypes
from typing import Any, Protocol

import torch
from torch import nn

from pagedllm import platform
from pagedllm.attention.context import get_forward_context
from pagedllm.attention.cpu_backend import CpuAttentionMetadata
from pagedllm.layers.cpu_ops import AMX_GEMM_ROWS, DTYPE_CODES, CpuKernels
from pagedllm.layers.quant import DENSE_ROWS, QuantTensor


class DecoderModel(Protocol):
    """What the stack reads of a Llama-family model (``models/llama.py``'s ``LlamaModel``, which
    builds the stack: naming it here would make the two modules import each other)."""

    layers: torch.nn.ModuleList
    norm: torch.nn.Module


_P = ctypes.c_void_p


_AMX_PLAIN = -1
"""A _LayerPlan qtype: the plain bf16 weight on AMX tiles (csrc/decoder.cpp's kAmxPlain)."""


class _LayerPlan(ctypes.Structure):
    _fields_ = [*[(name, _P) for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up",
                                          "gate_up_bias", "down", "down_bias", "k_cache", "v_cache")],
                *[(name, ctypes.c_int) for name in ("qkv_qtype", "o_qtype", "gate_up_qtype", "down_qtype")],
                ("qkv2", _P), ("qkv2_offset", ctypes.c_int64), ("qkv2_qtype", ctypes.c_int)]


class _StackPlan(ctypes.Structure):
    _fields_ = [*[(name, ctypes.c_int64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim",
                                                      "intermediate", "block_size", "num_blocks", "max_pos")],
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("dtype", ctypes.c_int), ("kv_int8", ctypes.c_int),
                ("attention_flags", ctypes.c_int),
                ("cos", _P), ("sin", _P), ("final_norm", _P), ("layer", ctypes.POINTER(_LayerPlan))]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _quant(linear: nn.Module, most: int = 1) -> list[tuple[int, QuantTensor]] | None:
    """The layer's weight when it is up to ``most`` packed GGUF segments (layers/quant.py: (row offset, rows) in
    order), the form the stack takes: one for every linear, two for qkv (llama.cpp's Q4_K_M gives some layers' v a
    format of its own)."""
    quant = getattr(linear, "quant", None)
    if quant is None or not 1 <= len(quant.pieces) <= most or not all(p.packed for p in quant.pieces.values()):
        return None
    return sorted(quant.pieces.items())


class CpuDecoderStack:
    """The plan of one model's decoder layers for ``pl_llama_stack``."""

    def __init__(self, model: DecoderModel, kernels: CpuKernels) -> None:
        self.kernels = kernels
        first = model.layers[0]
        attn, mlp = first.self_attn, first.mlp
        dtype = first.input_layernorm.weight.dtype
        self._keep: list[torch.Tensor] = []  # float32 bias copies the plan points into
        layers = (_LayerPlan * len(model.layers))()
        for plan, layer in zip(layers, model.layers):
            a, m = layer.self_attn, layer.mlp
            plan.input_norm = _ptr(layer.input_layernorm.weight)
            plan.post_norm = _ptr(layer.post_attention_layernorm.weight)
            plan.o, plan.o_bias = self._weight(a.o_proj, plan, "o"), _ptr(a.o_proj.bias)
            plan.down, plan.down_bias = self._weight(m.down_proj, plan, "down"), _ptr(m.down_proj.bias)
            plan.qkv = self._weight(a.qkv_proj, plan, "qkv", 2)  # column-parallel biases: float32 in our GEMM
            plan.qkv_bias = _ptr(a.qkv_proj.bias) if plan.qkv_qtype else self._float(a.qkv_proj.bias)
            if _quant(m.gate_up_proj) is not None or _amx(m.gate_up_proj, kernels):  # [gate; up], then SiLU-and-mul
                plan.gate_up = self._weight(m.gate_up_proj, plan, "gate_up")
                plan.gate_up_bias = _ptr(m.gate_up_proj.bias)
            else:
                plan.gate_up = _ptr(m.gate_up_proj.silu_packed.data)
                plan.gate_up_bias = self._float(m.gate_up_proj.silu_bias)
            plan.k_cache, plan.v_cache = _ptr(a.attn.kv_cache[0]), _ptr(a.attn.kv_cache[1])
        cache = attn.attn.kv_cache  # (2, num_blocks, kv_heads, block_size, head_dim), int8: (..., bs * (head_dim + 2))
        int8 = cache.dtype == torch.int8
        block_size = cache.shape[3] // (attn.head_dim + 2) if int8 else cache.shape[3]
        rotary = attn.rotary_emb
        self.plan = _StackPlan(
            layers=len(model.layers), hidden=first.input_layernorm.weight.numel(), heads=attn.num_heads,
            kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, intermediate=mlp.down_proj.input_size_per_partition,
            block_size=block_size, num_blocks=cache.shape[1], max_pos=rotary.cos_cache.shape[0],
            eps=first.input_layernorm.eps, scale=attn.attn.scale, dtype=DTYPE_CODES[dtype], kv_int8=int(int8),
            attention_flags=kernels.attention_flags,
            cos=_ptr(rotary.cos_cache),
            sin=_ptr(rotary.sin_cache), final_norm=_ptr(model.norm.weight), layer=layers)
        self._layers = layers
        amx = any(_AMX_PLAIN in (p.qkv_qtype, p.o_qtype, p.gate_up_qtype, p.down_qtype) for p in layers)
        dense = any(getattr(getattr(lin, "quant", None), "dense", None) is not None for layer in model.layers
                    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                layer.mlp.down_proj))
        limits = ([AMX_GEMM_ROWS] if amx else []) + ([DENSE_ROWS] if dense else [])
        self.max_rows = min(limits) if limits else None
        """Larger steps go layer by layer: their matmuls on oneDNN (AMX tiles), or on quantized weights' dense
        copies (layers/quant.py ``add_dense_copies``)."""
        intermediate = mlp.down_proj.input_size_per_partition
        self.work_cols = (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim + attn.num_heads * attn.head_dim \
            + intermediate + (2 * intermediate if any(p.gate_up_qtype for p in layers) else 0)

    @staticmethod
    def _weight(linear: nn.Module, plan: _LayerPlan, name: str, most: int = 1) -> int:
        """The pointer to a linear layer's packed weight; its GGUF type into the plan (0: our GEMM's), and a second
        quantized segment's (``most`` 2: qkv) as ``{name}2``."""
        segments = _quant(linear, most)
        if segments is None:  # our GEMM's packed copy, or the plain bf16 weight on AMX tiles
            setattr(plan, f"{name}_qtype", _AMX_PLAIN if linear.packed_weight.amx else 0)
            return linear.packed_weight.data.data_ptr()
        setattr(plan, f"{name}_qtype", segments[0][1].qtype)
        if len(segments) == 2:
            offset, second = segments[1]
            setattr(plan, f"{name}2", second.data.data_ptr())
            setattr(plan, f"{name}2_offset", offset)
            setattr(plan, f"{name}2_qtype", second.qtype)
        return segments[0][1].data.data_ptr()

    def _float(self, bias: torch.Tensor | None) -> int | None:
        if bias is None:
            return None
        self._keep.append(bias.detach().float().contiguous())
        return self._keep[-1].data_ptr()

    @classmethod
    def build(cls, model: DecoderModel) -> CpuDecoderStack | None:
        """The stack of ``model`` when every piece of it runs on the compiled kernels, else None."""
        if not platform.switches().cpu_stack or not model.layers:
            return None
        weight = model.layers[0].input_layernorm.weight
        kernels = getattr(model.layers[0].input_layernorm, "kernels", None)  # the layers' binding (custom_op.py)
        if kernels is None or not all(_eligible(layer, kernels, weight.dtype) for layer in model.layers):
            return None
        rotary = model.layers[0].self_attn.rotary_emb
        if rotary.cos_cache.dtype != weight.dtype or model.norm.weight.dtype != weight.dtype:
            return None
        return cls(model, kernels)

    def usable(self, hidden: torch.Tensor, positions: torch.Tensor) -> bool:
        """This step can run here: the cpu attention backend's metadata, its kernels the stack's, and at most
        ``max_rows`` rows where it has a bound."""
        ctx = get_forward_context()
        return (isinstance(ctx.metadata, CpuAttentionMetadata) and getattr(ctx.backend, "kernels", None) is self.kernels
                and positions.dtype == torch.int64 and hidden.is_contiguous()
                and (self.max_rows is None or hidden.shape[0] <= self.max_rows))

    def run(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Embeddings (tokens, hidden) -> the final norm's output, through every layer."""
        md = get_forward_context().metadata
        rows = hidden.shape[0]
        residual = torch.empty_like(hidden)
        work = torch.empty(rows, self.work_cols, dtype=hidden.dtype)  # qkv | attention out | SiLU out, per row
        self.kernels.llama_stack(ctypes.addressof(self.plan), hidden, residual, work, positions.contiguous(),
                                 md.slot_mapping, md.row_tables, md.row_seq_lens)
        return hidden


def _amx(linear: nn.Module, kernels: CpuKernels) -> bool:
    """The layer's weight stays plain for the AMX GEMM (layers/prepack.py, the "amx" level) of these kernels."""
    packed = getattr(linear, "packed_weight", None)
    return packed is not None and packed.amx and packed.kernels is kernels


def _eligible(layer: Any, kernels: CpuKernels, dtype: torch.dtype) -> bool:
    a, m = layer.self_attn, getattr(layer, "mlp", None)
    if not isinstance(getattr(m, "down_proj", None), nn.Module):  # a mixture of experts: not in the stack
        return False
    packed = [a.qkv_proj.packed_weight, a.o_proj.packed_weight, m.gate_up_proj.silu_packed, m.down_proj.packed_weight]
    linears = [a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj]
    quant = [_quant(lin, 2 if lin is a.qkv_proj else 1) for lin in linears]
    ours = [(p is not None and p.kernels is kernels and not p.amx) or _amx(lin, kernels)  # ours or AMX tiles
            for p, lin in zip(packed, linears)]
    return (all(own or (q is not None and all(s.level == kernels.level for _, s in q)) for own, q in zip(ours, quant))
            and all(getattr(lin, "lora", None) is None for lin in linears)  # the stack adds no adapter deltas
            and a.o_proj.tp_size == 1
            and not hasattr(a, "q_norm")  # the stack has no per-head q/k norms (Qwen3)
            and a.attn.sliding_window is None  # nor sliding windows
            and a.attn.kv_cache is not None and a.attn.kv_cache.is_contiguous()
            and layer.input_layernorm.weight.dtype == dtype == layer.post_attention_layernorm.weight.dtype
            and getattr(a.rotary_emb, "kernels", None) is kernels)
