"""A typed model-architecture config, normalised once from an HF config or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ArchConfig:
    """The facts a model definition needs (decoders; BERT-style encoders with the encoder fields at the end)."""

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
    hidden_act: str = "silu"
    """The MLP's activation: "silu" (gated), "gelu_new" (GPT-2's tanh GELU) or "relu" (OPT)."""
    norm_before: bool = True
    """LayerNorm before each block (pre-LN); False: after the residual add (OPT-350m's post-LN)."""
    word_embed_proj_dim: int | None = None
    """OPT: the embeddings' width when it differs from hidden_size (projected in and out)."""
    final_norm: bool = True
    """A norm after the last layer (OPT post-LN models have none)."""
    num_experts: int = 0
    """Mixture of experts: experts per MoE layer (0: a dense model)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Each expert's intermediate size."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE: the always-on shared expert's intermediate size (0: none)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1 (Mixtral always; Qwen2-MoE per config)."""
    moe_layers: tuple[int, ...] = ()
    """The layers whose MLP is the mixture (the others are dense)."""
    layer_types: tuple[str, ...] = ()
    """Per layer "sliding_attention" or "full_attention" (Gemma 2 alternates); empty: every layer the same."""
    query_pre_attn_scalar: float | None = None
    """Gemma 2: attention scores are scaled by this ** -0.5 instead of head_dim ** -0.5."""
    attn_logit_softcapping: float | None = None
    """Gemma 2: attention scores capped as c * tanh(s / c)."""
    final_logit_softcapping: float | None = None
    """Gemma 2: the output logits capped the same way."""
    local_rope_theta: float | None = None
    """Gemma 3: the sliding layers' rope base (their rope is unscaled); None: every layer uses rope_theta."""
    is_encoder_only: bool = False
    """BERT-style: bidirectional attention over whole inputs, no KV cache, hidden states pooled (never sampled).
    Encoders' LayerNorm epsilon is ``rms_norm_eps``; ``max_position_embeddings`` is their position table's rows."""
    type_vocab_size: int = 0
    """Encoders: rows of the token type (segment) table (BERT 2, RoBERTa 1)."""
    pad_token_id: int | None = None
    """Encoders: the padding token's id (RoBERTa counts its positions from it)."""
    position_offset: int = 0
    """Rows of the position table before a sequence's first token (RoBERTa: pad_token_id + 1)."""
    num_labels: int = 0
    """Sequence classifiers: the classification head's outputs (0 for every other model)."""
    id2label: tuple[str, ...] = ()
    """Sequence classifiers: label names in index order, where the config names them."""
    problem_type: str = ""
    """Sequence classifiers: transformers' ``problem_type`` where config.json sets it. "multi_label_classification":
    a sigmoid per label; "regression": the raw outputs; otherwise a softmax. One label: a sigmoid always."""
    local_attention: int = 0
    """ModernBERT: the sliding layers' whole window: a token sees those within local_attention // 2 of it."""
    norm_bias: bool = True
    """ModernBERT: whether its LayerNorms have a bias."""
    classifier_pooling: str = "cls"
    """ModernBERT classifiers: "cls" (the first token's state) or "mean" (every token's) feeds the head."""
    classifier_bias: bool = True
    """ModernBERT classifiers: a bias in the head's dense layer."""
    classifier_activation: str = "gelu"
    """ModernBERT classifiers: the head's activation."""

    @property
    def embeds_width(self) -> int:
        """The width of the token embeddings a prompt given as embeddings has (OPT's word_embed_proj_dim)."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window_of(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: it attends to everything)."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    @property
    def every_layer_slides(self) -> bool:
        """All layers have the sliding window: blocks before a request's window can go back to the pool."""
        return all(self.window_of(i) is not None for i in range(self.num_layers))

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ArchConfig:
        """From a config.json dict (transformers 4 ``rope_scaling`` or 5 ``rope_parameters``)."""
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch == "GPT2LMHeadModel":
            return cls._from_gpt2(hf)
        if arch == "OPTForCausalLM":
            return cls._from_opt(hf)
        if arch in ENCODER_ARCHITECTURES:
            return cls._from_bert(arch, hf)
        if arch in MODERNBERT_ARCHITECTURES:
            return cls._from_modernbert(arch, hf)
        rope, rope_theta, rope_type, local_theta = _rope(hf)
        num_heads = hf["num_attention_heads"]
        family = arch.replace("ForSequenceClassification", "ForCausalLM")  # a decoder classifier: its LM's flags
        is_qwen2 = family in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        is_qwen3 = family == "Qwen3ForCausalLM"
        eos = hf.get("eos_token_id")
        window = hf.get("sliding_window") if hf.get("use_sliding_window", not (is_qwen2 or is_qwen3)) else None
        layer_types = tuple(hf.get("layer_types") or ())
        if window is not None and (is_qwen2 or is_qwen3) and not layer_types:  # only the layers from max_window_layers
            first = hf.get("max_window_layers", hf["num_hidden_layers"])
            layer_types = tuple("sliding_attention" if i >= first else "full_attention"
                                for i in range(hf["num_hidden_layers"]))
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
            # Gemma's configs leave it out: transformers' Gemma classes default to tied
            tie_word_embeddings=hf.get("tie_word_embeddings", arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")),
            qkv_bias=is_qwen2 or hf.get("attention_bias", False),
            o_bias=(not is_qwen2) and hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=as_id_tuple(eos),
            qk_norm=is_qwen3 or arch == "Gemma3ForCausalLM",
            **_labels(arch, hf),
            **{"layer_types": layer_types, **_moe_fields(arch, hf), **_gemma_fields(arch, hf, local_theta)},
        )


    @classmethod
    def _learned_positions(cls, arch: str, hf: dict[str, Any], **fields: Any) -> ArchConfig:
        """GPT-2 / OPT: multi-head attention, learned positions (no rotary), LayerNorm, biases."""
        heads = fields.pop("num_heads")
        return cls(architecture=arch, vocab_size=hf["vocab_size"], num_heads=heads, num_kv_heads=heads,
                   head_dim=fields["hidden_size"] // heads, rope_theta=10000.0, rope_scaling=None,
                   tie_word_embeddings=hf.get("tie_word_embeddings", True), sliding_window=None,
                   bos_token_id=hf.get("bos_token_id"), eos_token_ids=as_id_tuple(hf.get("eos_token_id")), **fields)

    @classmethod
    def _from_gpt2(cls, hf: dict[str, Any]) -> ArchConfig:
        from pagedllm.errors import ValidationError

        for key, want in (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True),
                          ("add_cross_attention", False)):
            if hf.get(key, want) != want:
                raise ValidationError.bad_value(key, hf[key], f"{want} (GPT-2 variants with it are not supported)")
        hidden = hf["n_embd"]
        return cls._learned_positions(
            "GPT2LMHeadModel", hf, hidden_size=hidden, intermediate_size=hf.get("n_inner") or 4 * hidden,
            num_layers=hf["n_layer"], num_heads=hf["n_head"], rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            max_position_embeddings=hf.get("n_positions", 1024), qkv_bias=True, o_bias=True, mlp_bias=True,
            hidden_act=hf.get("activation_function", "gelu_new"))

    @classmethod
    def _from_opt(cls, hf: dict[str, Any]) -> ArchConfig:
        from pagedllm.errors import ValidationError

        if not hf.get("layer_norm_elementwise_affine", True):
            raise ValidationError.bad_value("layer_norm_elementwise_affine", False,
                                            "True (OPT without it is not supported)")
        hidden, bias = hf["hidden_size"], hf.get("enable_bias", True)
        proj = hf.get("word_embed_proj_dim", hidden)
        before = hf.get("do_layer_norm_before", True)
        return cls._learned_positions(
            "OPTForCausalLM", hf, hidden_size=hidden, intermediate_size=hf["ffn_dim"],
            num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"], rms_norm_eps=1e-5,
            max_position_embeddings=hf.get("max_position_embeddings", 2048), qkv_bias=bias, o_bias=bias,
            mlp_bias=bias, hidden_act=hf.get("activation_function", "relu"), norm_before=before,
            word_embed_proj_dim=None if proj == hidden else proj,
            final_norm=before and not hf.get("_remove_final_layer_norm", False))

    @classmethod
    def _from_bert(cls, arch: str, hf: dict[str, Any]) -> ArchConfig:
        """BERT / RoBERTa / XLM-R: post-LN encoder blocks, exact GELU, learned positions (RoBERTa's start at
        pad_token_id + 1) and token types; a sequence classifier's labels."""
        from pagedllm.errors import ValidationError

        for key, want in (("position_embedding_type", "absolute"), ("is_decoder", False),
                          ("add_cross_attention", False)):
            if hf.get(key, want) != want:
                raise ValidationError.bad_value(key, hf[key], f"{want!r} (encoders with it are not supported)")
        roberta = arch.startswith(("Roberta", "XLMRoberta"))
        pad = hf.get("pad_token_id")
        offset = (1 if pad is None else pad) + 1 if roberta else 0  # RoBERTa: 1 + the pad id (transformers': 1)
        return cls._learned_positions(
            arch, hf, hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
            rms_norm_eps=hf.get("layer_norm_eps", 1e-12),
            max_position_embeddings=hf.get("max_position_embeddings", 512),
            qkv_bias=True, o_bias=True, mlp_bias=True, hidden_act=hf.get("hidden_act", "gelu"), norm_before=False,
            final_norm=False, is_encoder_only=True, type_vocab_size=hf.get("type_vocab_size", 2), pad_token_id=pad,
            position_offset=offset, **_labels(arch, hf))

    @classmethod
    def _from_modernbert(cls, arch: str, hf: dict[str, Any]) -> ArchConfig:
        """ModernBERT: pre-LN encoder blocks, GeGLU MLP, rotary positions (one base for the global layers,
        another for the local ones), every global_attn_every_n_layers-th layer global, the others windowed.
        transformers 5 writes ``layer_types`` and ``rope_parameters`` per layer type; older configs
        ``global_rope_theta`` / ``local_rope_theta`` and only ``global_attn_every_n_layers``."""
        from pagedllm.errors import ValidationError

        layers = hf["num_hidden_layers"]
        every = hf.get("global_attn_every_n_layers", 3)
        layer_types = tuple(hf.get("layer_types") or ("sliding_attention" if i % every else "full_attention"
                                                      for i in range(layers)))
        rope = hf.get("rope_parameters") or {}
        if "full_attention" not in rope:  # transformers 4 (or one rope for both types)
            rope = {"full_attention": dict(rope), "sliding_attention": dict(rope)}
        full, local = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
        theta = full.pop("rope_theta", hf.get("global_rope_theta", 160000.0))
        local_theta = local.get("rope_theta", hf.get("local_rope_theta", 10000.0))
        for name, params in (("full_attention", full), ("sliding_attention", local)):
            kind = params.get("rope_type", params.get("type", "default"))
            if kind != "default" and (name == "sliding_attention" or kind not in ("linear", "llama3")):
                raise ValidationError.bad_value("rope_parameters", rope, "default rope (global layers: linear "
                                                "or llama3 scaling too) for ModernBERT")
        scaling = None if full.get("rope_type", full.get("type", "default")) == "default" else full
        heads = hf["num_attention_heads"]
        return cls(
            architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=layers, num_heads=heads, num_kv_heads=heads,
            head_dim=hf["hidden_size"] // heads, rms_norm_eps=hf.get("norm_eps", 1e-5), rope_theta=float(theta),
            rope_scaling=scaling, max_position_embeddings=hf.get("max_position_embeddings", 8192),
            tie_word_embeddings=False, qkv_bias=hf.get("attention_bias", False),
            o_bias=hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False), sliding_window=None,
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=as_id_tuple(hf.get("eos_token_id")),
            hidden_act=hf.get("hidden_activation", "gelu"), final_norm=True, layer_types=layer_types,
            local_rope_theta=float(local_theta), is_encoder_only=True, pad_token_id=hf.get("pad_token_id"),
            local_attention=hf.get("local_attention", 128), norm_bias=hf.get("norm_bias", False),
            classifier_pooling=hf.get("classifier_pooling", "cls"),
            classifier_bias=hf.get("classifier_bias", False),
            classifier_activation=hf.get("classifier_activation", "gelu"), **_labels(arch, hf))


ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification", "RobertaModel",
                         "RobertaForMaskedLM", "RobertaForSequenceClassification", "XLMRobertaModel",
                         "XLMRobertaForMaskedLM", "XLMRobertaForSequenceClassification")
"""The BERT-family architectures ``ArchConfig.from_hf`` reads (models/bert.py runs them)."""
MODERNBERT_ARCHITECTURES = ("ModernBertModel", "ModernBertForSequenceClassification")
"""The ModernBERT architectures it reads (models/modernbert.py runs them)."""


def _labels(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """A sequence classifier's num_labels and label names (id2label in index order); nothing for other models."""
    if not arch.endswith("ForSequenceClassification"):
        return {}
    names = {int(k): str(v) for k, v in (hf.get("id2label") or {}).items()}
    labels = tuple(names[i] for i in range(len(names))) if names and sorted(names) == list(range(len(names))) else ()
    return dict(num_labels=len(names) or hf.get("num_labels", 2), id2label=labels,  # transformers' default: 2
                problem_type=str(hf.get("problem_type") or ""))


def _gemma_fields(arch: str, hf: dict[str, Any], local_theta: float | None) -> dict[str, Any]:
    """Gemma 2 / 3: GeGLU, sliding layers among full ones (every other one; Gemma 3: five of six), scores
    and logits soft-capped (Gemma 2), the sliding layers' own rope base (Gemma 3)."""
    if arch not in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return {}
    layers = hf["num_hidden_layers"]
    pattern = 2 if arch == "Gemma2ForCausalLM" else hf.get("sliding_window_pattern") or 6
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                      for i in range(layers)]
    return dict(hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
                layer_types=tuple(types), query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
                attn_logit_softcapping=hf.get("attn_logit_softcapping"),
                final_logit_softcapping=hf.get("final_logit_softcapping"),
                local_rope_theta=None if local_theta is None else float(local_theta))


def _rope(hf: dict[str, Any]) -> tuple[dict[str, Any], float, str, Any]:
    """(rope scaling fields, rope_theta, rope type, Gemma 3's local-layer theta) of a config.json dict
    (transformers 4 ``rope_scaling`` or 5 ``rope_parameters``); partial rotary refused."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    local_theta = hf.get("rope_local_base_freq")
    if "full_attention" in rope:  # transformers 5, Gemma 3: one rope per layer type
        local_theta = (rope.get("sliding_attention") or {}).get("rope_theta", local_theta)
        rope = dict(rope["full_attention"])
    rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "longrope":  # transformers 4 keeps these beside rope_scaling
        rope.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        rope.setdefault("max_position_embeddings", hf.get("max_position_embeddings"))
    partial = rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        from pagedllm.errors import ValidationError
        raise ValidationError.bad_value("partial_rotary_factor", partial, "1.0 (partial rotary is not supported yet)")
    return rope, rope_theta, rope_type, local_theta


def _moe_fields(arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of Mixtral's and Qwen2-MoE's configs (none for dense models)."""
    layers = hf["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        return dict(num_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["intermediate_size"], moe_layers=tuple(range(layers)))
    if arch == "Qwen2MoeForCausalLM":
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
        experts = hf["num_experts"]
        moe = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
        return dict(num_experts=experts, num_experts_per_tok=hf["num_experts_per_tok"],
                    moe_intermediate_size=hf["moe_intermediate_size"],
                    shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0),
                    norm_topk_prob=hf.get("norm_topk_prob", False), moe_layers=moe)
    return {}


def as_id_tuple(value: Any) -> tuple[int, ...]:
    """A config's token id entry (an int, a list of ints or None) as a tuple."""
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(int(v) for v in value)
