"""GGUF files: config from the metadata, tensors dequantized with the `gguf` package.

llama.cpp stores Q and K projections of the "llama" architecture with rows permuted for its
interleaved rotary layout; they are permuted back to HF's rotate-half layout here.
"""
from __future__ import annotations

import functools
import mmap
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pagedllm.errors import ValidationError
from pagedllm.models.config import ArchConfig, as_id_tuple
from pagedllm.platform import heap

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gpt2": "GPT2LMHeadModel", "qwen2moe": "Qwen2MoeForCausalLM", "phi3": "Phi3ForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
"""GGUF architecture -> ours ("llama" with experts is Mixtral: see _architecture)."""

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GEMMA_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
# per architecture, where its names differ from Llama's. Phi-3: q|k|v and gate|up packed as in its checkpoints.
# Mixtures of experts: the router, the shared expert (Qwen2-MoE), and every expert's matrices stacked in
# one tensor ({e}: split per expert on load, under transformers' per-expert names)
_ARCH_NAMES = {
    "Phi3ForCausalLM": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "Gemma2ForCausalLM": _GEMMA_NAMES, "Gemma3ForCausalLM": _GEMMA_NAMES,
    "MixtralForCausalLM": {"ffn_gate_inp": "block_sparse_moe.gate",
                           "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
                           "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                           "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"},
    "Qwen2MoeForCausalLM": {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
                            "ffn_up_exps": "mlp.experts.{e}.up_proj", "ffn_down_exps": "mlp.experts.{e}.down_proj",
                            "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                            "ffn_up_shexp": "mlp.shared_expert.up_proj",
                            "ffn_down_shexp": "mlp.shared_expert.down_proj",
                            "ffn_gate_inp_shexp": "mlp.shared_expert_gate"},
}
# GPT-2: llama.cpp's names -> transformers' (its Conv1D weights are stored (out, in), as linear layers)
_GPT2_LAYER_NAMES = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                     "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_GPT2_TOP_NAMES = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                   "output_norm": "transformer.ln_f", "output": "lm_head"}


@functools.lru_cache(maxsize=1)
def _reader(path: str):
    """The parsed file (memory-mapped); cached because parsing the vocabulary takes seconds."""
    from gguf import GGUFReader

    return GGUFReader(path)


def _metadata(reader) -> dict[str, Any]:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[1] in ("tokens", "scores", "token_type", "merges"):
            continue  # large arrays the tokenizer reads itself
        out[key] = field.contents()
    return out


def load_arch_config(path: str) -> ArchConfig:
    """A GGUF file's architecture from its metadata and tensor shapes (GPT-2, Phi-3 and Gemma 2/3 through their
    HF configs' fields; the Llama family, Mixtral and Qwen2-MoE directly)."""
    reader = _reader(path)
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValidationError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHITECTURES)}",
                              param="model", value=arch)
    experts = meta.get(f"{arch}.expert_count") or 0
    architecture = "MixtralForCausalLM" if arch == "llama" and experts else _ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    tensor_shapes = {t.name: list(reversed(t.shape.tolist())) for t in reader.tensors}  # torch order
    if arch == "gpt2":  # the HF config's fields, read by the same code as an HF folder's
        return ArchConfig._from_gpt2({
            "n_embd": get("embedding_length"), "n_layer": get("block_count"), "n_head": get("attention.head_count"),
            # the converter writes 4 * n_embd here whatever n_inner is: the tensor says
            "n_inner": tensor_shapes["blk.0.ffn_up.weight"][0], "n_positions": get("context_length", 1024),
            "layer_norm_epsilon": float(get("attention.layer_norm_epsilon", 1e-5)),
            "vocab_size": tensor_shapes["token_embd.weight"][0],
            "tie_word_embeddings": "output.weight" not in tensor_shapes,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        })
    if arch in ("phi3", "gemma2", "gemma3"):  # as the HF config's fields, read by the same code as an HF folder's
        return ArchConfig.from_hf(_hf_config(reader, meta, arch, architecture, tensor_shapes))
    return _llama_family(reader, meta, arch, architecture, experts)


def _llama_family(reader: Any, meta: dict[str, Any], arch: str, architecture: str, experts: int) -> ArchConfig:
    """The Llama family's config (Llama, Mistral, Qwen2/3, Mixtral, Qwen2-MoE) from llama.cpp's keys."""

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    scaling = None
    if get("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": get("rope.scaling.type"), "factor": get("rope.scaling.factor")}
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:  # llama.cpp keeps Llama 3.1 rope scaling as per-frequency divisors
        scaling = {"rope_type": "freq_factors", "freq_factors": _small_tensor(reader, "rope_freqs.weight")}
    moe = {}
    if experts:
        layers = get("block_count")
        moe = dict(num_experts=experts, num_experts_per_tok=get("expert_used_count"),
                   moe_intermediate_size=get("expert_feed_forward_length") or get("feed_forward_length"),
                   shared_expert_intermediate_size=get("expert_shared_feed_forward_length") or 0,
                   # llama.cpp renormalises Mixtral's top-k weights, not Qwen2-MoE's
                   norm_topk_prob=architecture == "MixtralForCausalLM", moe_layers=tuple(range(layers)))
    return ArchConfig(
        architecture=architecture,
        vocab_size=get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv", num_heads),
        head_dim=get("attention.key_length", hidden // num_heads),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias=False,
        sliding_window=None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=as_id_tuple(meta.get("tokenizer.ggml.eos_token_id")),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        **moe,
    )


def _small_tensor(reader, name: str) -> list[float]:
    """A small tensor of the file (rope factors) as a list."""
    from gguf.quants import dequantize

    tensor = next(t for t in reader.tensors if t.name == name)
    return dequantize(tensor.data, tensor.tensor_type).reshape(-1).tolist()


def _hf_config(reader, meta: dict[str, Any], arch: str, architecture: str,
               shapes: dict[str, list[int]]) -> dict[str, Any]:
    """Phi-3 and Gemma 2/3 metadata as their HF config.json fields. What llama.cpp's converter leaves out is
    what llama.cpp itself assumes: Gemma 2 slides on every other layer, Gemma 3 on five of six with a rope
    base of 10000 there, and scores scaled by head_dim ** -0.5 (hidden / heads for the 27B models)."""
    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    layers, heads, hidden = get("block_count"), get("attention.head_count"), get("embedding_length")
    head_dim = get("attention.key_length") or hidden // heads
    hf: dict[str, Any] = {
        "architectures": [architecture], "vocab_size": shapes["token_embd.weight"][0], "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"), "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads), "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": get("context_length", 4096), "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "sliding_window": get("attention.sliding_window") or None,
    }
    theta = float(get("rope.freq_base", 10000.0))
    rope_dims = get("rope.dimension_count") or head_dim
    if rope_dims != head_dim:
        hf["partial_rotary_factor"] = rope_dims / head_dim  # refused by from_hf with the parameter's name
    if arch == "phi3":
        hf["rope_theta"] = theta
        if "rope_factors_long.weight" in shapes:  # LongRoPE: per-frequency factors before/after the original length
            hf["rope_scaling"] = {"rope_type": "longrope",
                                  "long_factor": _small_tensor(reader, "rope_factors_long.weight"),
                                  "short_factor": _small_tensor(reader, "rope_factors_short.weight"),
                                  "original_max_position_embeddings": get("rope.scaling.original_context_length")}
        return hf
    big = layers == (46 if arch == "gemma2" else 62)  # llama.cpp's test for the 27B models
    pattern = get("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    slides = (list(pattern) if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(layers)])
    hf.update(query_pre_attn_scalar=hidden / heads if big else head_dim, hidden_activation="gelu_pytorch_tanh",
              layer_types=["sliding_attention" if s else "full_attention" for s in slides],
              attn_logit_softcapping=get("attn_logit_softcapping"),
              final_logit_softcapping=get("final_logit_softcapping"))
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if get("rope.scaling.type") not in (None, "none"):
        full.update(rope_type=get("rope.scaling.type"), factor=get("rope.scaling.factor"))
    hf["rope_parameters"] = {"full_attention": full} if arch == "gemma2" else {
        "full_attention": full, "sliding_attention": {"rope_theta": float(get("rope.freq_base_swa", 10000.0))}}
    return hf


def _hf_name(gguf_name: str, architecture: str = "LlamaForCausalLM") -> str | None:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight / bias
    parts = base.split(".")
    gpt2 = architecture == "GPT2LMHeadModel"
    layer_names, top_names, prefix = ((_GPT2_LAYER_NAMES, _GPT2_TOP_NAMES, "transformer.h") if gpt2 else
                                      ({**_LAYER_NAMES, **_ARCH_NAMES.get(architecture, {})}, _TOP_NAMES,
                                       "model.layers"))
    if parts[0] == "blk" and parts[2] in layer_names:
        return f"{prefix}.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    if base in top_names:
        return f"{top_names[base]}.{suffix}"
    return None


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation: rows stored (heads, dim/2, 2) go back to (heads, 2, dim/2)."""
    rows = w.shape[0]
    per_head = w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])  # (heads, half, 2, ...)
    return per_head.swapaxes(1, 2).reshape(w.shape)


def kept_types(path: str, config: ArchConfig) -> set[str]:
    """The quantized formats of the file's matrices that ``quantization="gguf"`` keeps (layers/quant.py)."""
    from pagedllm.layers.quant import GGML_TYPES

    names = {code: name for name, code in GGML_TYPES.items()}
    return {names[qtype] for _, qtype, _, _, _ in kept_tensors(path, config)}


def kept_tensors(path: str, config: ArchConfig) -> Iterator[tuple[str, int, int, int, int]]:
    """(GGUF name, GGML type, rows, columns, bytes in the file) of every matrix that ``quantization="gguf"`` keeps
    in its format."""
    from pagedllm.layers.quant import GGML_TYPES

    if config.architecture == "GPT2LMHeadModel":  # its Conv1D weights are transposed: always dequantized
        return
    kept = set(GGML_TYPES.values())
    for t in _reader(path).tensors:
        if len(t.shape) == 2 and int(t.tensor_type) in kept and _hf_name(t.name, config.architecture):
            cols, rows = (int(n) for n in t.shape)  # GGUF's dims fastest-first
            yield t.name, int(t.tensor_type), rows, cols, int(t.n_bytes)


def iter_weights(path: str, config: ArchConfig, quantized: bool = False,
                 dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) for every tensor of the file: matrices dequantized to ``dtype`` (vectors to float32);
    with ``quantized``, matrices of the formats layers/quant.py keeps come as QuantTensors (their rows as the
    file has them). Each tensor's pages of the file are unmapped once the next one is asked for (``_release``)."""
    from pagedllm.layers.quant import GGML_TYPES, QuantTensor

    reader = _reader(path)
    permuted = config.architecture in ("LlamaForCausalLM", "MixtralForCausalLM")  # llama.cpp's "llama" layout
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, config.architecture)
        if name is None:
            continue
        shape = list(reversed(tensor.shape.tolist()))  # GGUF stores dims fastest-first: torch's (out, in)
        data = tensor.data  # a view of the memory map: (..., rows, values or bytes of a row)
        if permuted and name.endswith("q_proj.weight"):
            data = _unpermute(data, config.num_heads)  # rows as HF has them; whole rows: before or after decoding
        elif permuted and name.endswith("k_proj.weight"):
            data = _unpermute(data, config.num_kv_heads)
        if (quantized and len(shape) == 2 and int(tensor.tensor_type) in GGML_TYPES.values()
                and config.architecture != "GPT2LMHeadModel"):  # GPT-2's Conv1D weights are transposed below
            rows = data.reshape(shape[0], -1)  # (out, bytes of a row): rows as stored
            if np.may_share_memory(rows, reader.data):
                rows = np.array(rows)  # off the map: these bytes are kept (the map's pages are released)
            yield name, QuantTensor(int(tensor.tensor_type), shape[0], shape[1], torch.from_numpy(rows))
            _release(reader, tensor)
            heap.trim()  # the unpermuted rows' transient copy (platform/heap.py)
            continue
        weight = _dequantize(data, tensor.tensor_type, shape, dtype if len(shape) > 1 else torch.float32)
        if config.architecture.startswith("Gemma") and name.endswith("norm.weight"):
            weight = weight - 1  # llama.cpp stores Gemma's norms as 1 + w, ours add the 1 themselves
        if config.architecture == "GPT2LMHeadModel" and weight.dim() == 2 and any(
                f".{m}." in name for m in ("c_attn", "c_proj", "c_fc")):
            weight = weight.T  # back to transformers' Conv1D (in, out), as an HF folder has it
        if "{e}" in name:  # (experts, rows, cols): one tensor per expert
            for expert in range(weight.shape[0]):
                yield name.format(e=expert), weight[expert]
        else:
            yield name, weight
        del weight
        _release(reader, tensor)
        heap.trim()  # the decoded tensor and its slices' temporaries (platform/heap.py)


_DEQUANTIZE_BYTES = 2 * 1024**2
"""Float32 values decoded at a time: a whole embedding table's would be twice its bf16 copy (Llama-3-8B's 2 GiB)."""


def _dequantize(data: np.ndarray, qtype: Any, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """``data`` (the file's rows: values, or bytes of quantized blocks) decoded into a new ``dtype`` tensor of
    torch shape ``shape``, a slice of rows at a time (the float32 decode of each slice is transient)."""
    from gguf.quants import dequantize

    cols = shape[-1]
    flat = data.reshape(-1, data.shape[-1])  # (rows, values or bytes of a row)
    out = torch.empty(flat.shape[0], cols, dtype=dtype)  # (rows, cols)
    step = max(1, _DEQUANTIZE_BYTES // (4 * cols))
    for start in range(0, flat.shape[0], step):
        values = dequantize(flat[start:start + step], qtype)  # (step, cols) float32 (F32: a view of the map)
        if not values.flags.writeable:
            values = values.copy()  # torch takes writable arrays only
        out[start:start + step] = torch.from_numpy(values).view(-1, cols)  # (step, cols)
    return out.view(shape)


def _release(reader, tensor) -> None:
    """Unmap the file pages of ``tensor`` from this process (madvise DONTNEED): a page of the map that was read
    counts in the RSS (RssFile) while it stays mapped, so reading the whole file held its size on top of the
    weights made from it. The pages stay in the page cache; a later read maps them again (the map is read only)."""
    mapped = getattr(reader.data, "_mmap", None)
    if mapped is None:
        return
    start = tensor.data_offset - tensor.data_offset % mmap.PAGESIZE
    mapped.madvise(mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start)
