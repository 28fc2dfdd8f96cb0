"""A typed model-architecture config, normalised once from an HF config or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchConfig:
    """The facts a decoder-only model definition needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    """Every id the checkpoint's config names as EOS (Llama 3 lists several)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before the rotary embedding (Qwen3)."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ArchConfig":
        """From a config.json dict (transformers 4 ``rope_scaling`` or 5 ``rope_parameters``)."""
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        num_heads = hf["num_attention_heads"]
        is_qwen2 = arch == "Qwen2ForCausalLM"
        is_qwen3 = arch == "Qwen3ForCausalLM"
        eos = hf.get("eos_token_id")
        window = hf.get("sliding_window") if hf.get("use_sliding_window", not (is_qwen2 or is_qwen3)) else None
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=is_qwen2 or hf.get("attention_bias", False),
            o_bias=(not is_qwen2) and hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=as_id_tuple(eos),
            qk_norm=is_qwen3,
        )


def as_id_tuple(value: Any) -> tuple[int, ...]:
    """A config's token id entry (an int, a list of ints or None) as a tuple."""
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(int(v) for v in value)
