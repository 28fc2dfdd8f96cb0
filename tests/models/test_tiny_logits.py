"""Our models (Llama family, Qwen3, GPT-2, OPT) against transformers on tiny random configs of every
variant, at every instruction-set level this CPU runs (the portable torch path included).

The prompt goes through the real paged path: chunked prefill over a cached prefix, single-token
decodes, two sequences in one step, block tables with scattered physical blocks.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm.attention.context import forward_context
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.extension import make_worker
from pagedllm.worker.input_batch import CachedRequestState, build_step_inputs
from tests.utils import TINY_VARIANTS

BLOCK_SIZE = 4


def hf_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]  # (len, vocab)


def paged_logits(path: Path, sequences: list[list[int]], schedule: list[list[int]],
                 dtype: str = "float32", **options: object) -> list[torch.Tensor]:
    """Run ``sequences`` through our model; ``schedule[step][i]`` tokens of sequence i per step; ``options``
    are more engine options (e.g. quantization).

    Returns each sequence's logits at every position, computed step by step through the cache.
    """
    config, arch = EngineArgs(model=str(path), dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=64,
                              **options).create_engine_config()
    worker = make_worker(config, arch, eos_token_ids=())
    worker.initialize_cache(64)
    runner = worker.model_runner
    free = list(range(63, 0, -1))  # hand out blocks high ids first: tables are not contiguous
    states = [CachedRequestState(req_id=str(i), token_ids=seq, num_prompt_tokens=len(seq),
                                 sampling_params=SamplingParams(), generator=None) for i, seq in enumerate(sequences)]
    logits: list[list[torch.Tensor]] = [[] for _ in sequences]
    for step in schedule:
        active = [(s, n) for s, n in zip(states, step) if n]
        order = runner.builder.order({s.req_id: n for s, n in active})  # the backend's batch order
        active.sort(key=lambda sn: order.index(sn[0].req_id))
        for s, n in active:
            while len(s.block_ids) * BLOCK_SIZE < s.num_computed_tokens + n:
                s.block_ids.append(free.pop(len(free) // 2))
        inputs = build_step_inputs([s for s, _ in active], [n for _, n in active], BLOCK_SIZE)
        meta = runner.builder.build(inputs)
        with torch.inference_mode(), forward_context(runner.backend, meta):
            out = runner.model.compute_logits(runner.model(inputs.input_ids, inputs.positions))
        qsl = inputs.query_start_loc.tolist()
        for row, (s, n) in enumerate(active):
            logits[int(s.req_id)].append(out[qsl[row]:qsl[row + 1]].float())
            s.num_computed_tokens += n
    return [torch.cat(parts) for parts in logits]


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_logits_match_transformers(variant: str, tiny_model, level: str) -> None:
    path = tiny_model(variant)
    g = torch.Generator().manual_seed(1)
    seq_a = torch.randint(3, 512, (23,), generator=g).tolist()
    seq_b = torch.randint(3, 512, (13,), generator=g).tolist()
    # A: chunk of 8, chunk of 1 (batched as a decode), chunk of 6 over the prefix, then decodes.
    # B: joins in step 1 with 5 tokens, finishes its prompt in step 2 next to A's decode.
    schedule = [[8, 5], [1, 8], [6, 0]] + [[1, 0]] * 8
    ours_a, ours_b = paged_logits(path, [seq_a, seq_b], schedule)
    for ours, seq in ((ours_a, seq_a), (ours_b, seq_b)):
        ref = hf_logits(path, seq)
        assert ours.shape == ref.shape
        rel = (ours - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"{variant} at {level}: relative logits error {rel:.2e}"
        assert ref.abs().max() > 0.1, "logits too small for the comparison to mean anything"


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_bfloat16_logits_stay_close(variant: str, tiny_model) -> None:
    """Every family runs in bfloat16: its logits within bf16 rounding of transformers' float32 ones."""
    path = tiny_model(variant)
    seq = torch.randint(3, 512, (17,), generator=torch.Generator().manual_seed(2)).tolist()
    (ours,) = paged_logits(path, [seq], [[9], [8]], dtype="bfloat16")
    ref = hf_logits(path, seq)
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 5e-2, f"{variant}: bfloat16 relative logits error {rel:.2e}"


def test_config_variants_are_what_they_claim(tiny_model) -> None:
    """The tiny configs really exercise GQA, qkv bias, tying and rope scaling in our model."""
    from pagedllm.models.loader import load_arch_config

    cfgs = {v: load_arch_config(str(tiny_model(v))) for v in TINY_VARIANTS}
    assert cfgs["llama-gqa-untied"].num_kv_heads < cfgs["llama-gqa-untied"].num_heads
    assert not cfgs["llama-gqa-untied"].tie_word_embeddings and cfgs["llama-mha-tied"].tie_word_embeddings
    assert cfgs["qwen2-qkv-bias"].qkv_bias and not cfgs["qwen2-qkv-bias"].o_bias
    assert cfgs["llama-attention-bias"].qkv_bias and cfgs["llama-attention-bias"].o_bias
    assert cfgs["llama3-rope-scaling"].rope_scaling["rope_type"] == "llama3"
    assert cfgs["llama-linear-rope"].rope_scaling["rope_type"] == "linear"
    assert cfgs["mistral"].architecture == "MistralForCausalLM"
    assert cfgs["qwen3-qk-norm"].qk_norm and cfgs["qwen3-qk-norm"].head_dim == 32
    assert cfgs["gpt2"].architecture == "GPT2LMHeadModel" and cfgs["gpt2"].hidden_act == "gelu_new"
    assert cfgs["gpt2"].tie_word_embeddings and cfgs["gpt2"].intermediate_size == 128
    assert cfgs["opt-pre-ln"].norm_before and cfgs["opt-pre-ln"].final_norm and cfgs["opt-pre-ln"].hidden_act == "relu"
    opt350 = cfgs["opt-350m-style"]
    assert not opt350.norm_before and not opt350.final_norm and opt350.word_embed_proj_dim == 32
    assert cfgs["mixtral"].num_experts == 4 and cfgs["mixtral"].moe_layers == (0, 1) and cfgs["mixtral"].norm_topk_prob
    assert cfgs["phi3-longrope"].rope_scaling["rope_type"] == "longrope"
    g2, g3 = cfgs["gemma2"], cfgs["gemma3"]
    assert g2.window_of(0) == 6 and g2.window_of(1) is None and g2.attn_logit_softcapping == 2.0
    assert not g2.every_layer_slides and g2.attention_scale == 24 ** -0.5
    assert g3.qk_norm and g3.local_rope_theta == 10000.0 and g3.rope_theta == 1000000.0 and g3.window_of(1) is None
    moe = cfgs["qwen2-moe"]
    assert moe.moe_layers == (0, 2) and moe.shared_expert_intermediate_size == 48 and not moe.norm_topk_prob


def test_config_details_from_real_checkpoints() -> None:
    """Qwen2's use_sliding_window applies from max_window_layers on (only those layers slide); Gemma's
    configs leave tie_word_embeddings out (tied)."""
    from pagedllm.models.config import ArchConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)
    qwen = ArchConfig.from_hf({**base, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                               "sliding_window": 8, "max_window_layers": 2})
    assert [qwen.window_of(i) for i in range(4)] == [None, None, 8, 8] and not qwen.every_layer_slides
    gemma = ArchConfig.from_hf({**base, "architectures": ["Gemma2ForCausalLM"], "head_dim": 8})
    assert gemma.tie_word_embeddings and gemma.layer_types == ("sliding_attention", "full_attention") * 2
