"""ModernBERT (embedder and sequence classifier) against transformers on tiny random configs whose local windows
are shorter than the inputs, windowed bidirectional attention against a per-sequence reference, and both models
end to end through ``LLM.embed`` / ``LLM.classify``."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.attention.encoder import bidirectional_attention
from pagedllm.models.loader import load_arch_config
from tests.models.test_bert import load_ours, run_ours
from tests.tiny_tokenizer import save_word_tokenizer
from tests.utils import model_of

VOCAB = 100
LENS = [5, 1, 30, 17]
LOCAL = 8  # a local layer's token sees those within 4 positions: shorter than most inputs here


def save_modernbert(path: Path, head: str = "Model", seed: int = 0, **overrides: Any) -> Path:
    """A tiny random ``ModernBert{head}`` saved by transformers (LayerNorm weights and biases randomised too),
    with a word-level tokenizer."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  global_attn_every_n_layers=2, local_attention=LOCAL, max_position_embeddings=128,
                  initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                  sep_token_id=2, norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True)
    config = transformers.ModernBertConfig(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"ModernBert{head}")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    save_word_tokenizer(path, VOCAB)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple, Path] = {}

    def make(head: str = "Model", **overrides: Any) -> Path:
        key = (head, *sorted(overrides.items()))
        if key not in cache:
            cache[key] = save_modernbert(tmp_path_factory.mktemp(f"modernbert-{head}"), head, **overrides)
        return cache[key]

    return make


def random_ids(lens: list[int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lens]


def reference(folder: Path, head: str = "Model") -> torch.nn.Module:
    import transformers

    return getattr(transformers, f"ModernBert{head}").from_pretrained(folder, dtype=torch.float32,
                                                                       attn_implementation="sdpa").eval()


def test_arch_config(folders: Callable[..., Path]) -> None:
    cfg = load_arch_config(str(folders()))
    assert cfg.is_encoder_only and cfg.architecture == "ModernBertModel" and cfg.final_norm
    assert cfg.layer_types == ("full_attention", "sliding_attention", "full_attention")
    assert (cfg.local_attention, cfg.rope_theta, cfg.local_rope_theta) == (LOCAL, 160000.0, 10000.0)
    assert cfg.head_dim == 16 and cfg.norm_bias and cfg.qkv_bias and cfg.mlp_bias and cfg.sliding_window is None
    assert cfg.num_labels == 0
    hash(cfg)
    # transformers 4's config.json: global / local rope bases and the global layers' period only
    old = cfg.__class__.from_hf({"architectures": ["ModernBertForSequenceClassification"], "vocab_size": 10,
                                 "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 4,
                                 "num_attention_heads": 2, "global_attn_every_n_layers": 3,
                                 "global_rope_theta": 80000.0, "local_rope_theta": 5000.0, "num_labels": 2,
                                 "classifier_pooling": "mean"})
    assert old.layer_types == ("full_attention", "sliding_attention", "sliding_attention", "full_attention")
    assert (old.rope_theta, old.local_rope_theta, old.local_attention) == (80000.0, 5000.0, 128)
    assert (old.num_labels, old.classifier_pooling, old.norm_bias, old.classifier_bias) == (2, "mean", False, False)


def test_hidden_states_match_transformers(folders: Callable[..., Path]) -> None:
    path = folders()
    ids = random_ids(LENS)
    ours = run_ours(load_ours(path), ids, None)
    ref_model = reference(path)
    with torch.no_grad():
        ref = torch.cat([ref_model(input_ids=i[None]).last_hidden_state[0] for i in ids])
    assert ours.shape == ref.shape == (sum(LENS), 64)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_prefixed_and_unbiased(folders: Callable[..., Path], tmp_path: Path) -> None:
    """transformers' defaults (no biases in norms, projections and the head) and a ``model.``-prefixed encoder
    checkpoint (as classifiers save it) loaded as an embedder."""
    from safetensors.torch import load_file, save_file

    plain = folders(norm_bias=False, attention_bias=False, mlp_bias=False)
    ids = random_ids(LENS, seed=4)
    ref_model = reference(plain)
    with torch.no_grad():
        ref = torch.cat([ref_model(input_ids=i[None]).last_hidden_state[0] for i in ids])
    torch.testing.assert_close(run_ours(load_ours(plain), ids, None), ref, atol=1e-4, rtol=1e-4)
    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    (prefixed / "config.json").write_bytes((plain / "config.json").read_bytes())
    save_file({f"model.{k}": v for k, v in load_file(plain / "model.safetensors").items()},
              prefixed / "model.safetensors")
    torch.testing.assert_close(run_ours(load_ours(prefixed), ids, None), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_classifier_logits_match_transformers(pooling: str, folders: Callable[..., Path]) -> None:
    from pagedllm.layers.pooler import pool

    path = folders("ForSequenceClassification", num_labels=3, classifier_pooling=pooling)
    model = load_ours(path)
    assert model.is_encoder_only and model.default_pooling_type == pooling.upper()
    ids = random_ids(LENS, seed=2)
    with torch.inference_mode():
        logits = model.classify(pool(run_ours(model, ids, None), LENS, model.default_pooling_type))
    ref_model = reference(path, "ForSequenceClassification")
    with torch.no_grad():
        ref = torch.cat([ref_model(input_ids=i[None]).logits for i in ids])
    assert logits.dtype == torch.float32 and logits.shape == (len(LENS), 3)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float,
                         window: int) -> torch.Tensor:
    """Per sequence, softmax(q k^T * scale) v in float64 over keys within ``window`` positions."""
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))  # (heads, n, d)
        i = torch.arange(n)
        scores = (qs @ ks.transpose(1, 2) * scale).masked_fill((i[:, None] - i).abs() > window, float("-inf"))
        out.append((torch.softmax(scores, dim=-1) @ vs).transpose(0, 1))  # (n, heads, d)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[300], [5, 128, 1, 37, 64, 64, 17, 9, 300], [16] * 20,
                                  [int(n) for n in torch.randint(1, 70, (60,), generator=torch.Generator()
                                                                 .manual_seed(0))]])
def test_windowed_bidirectional_attention(dtype: torch.dtype, lens: list[int]) -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lens), 4, 32, generator=g).to(dtype) for _ in range(3))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for window in (4, 20):
        out = bidirectional_attention(q, k, v, lens, 32 ** -0.5, window)
        assert out.shape == q.shape and out.dtype == dtype
        torch.testing.assert_close(out.double(), _reference_attention(q, k, v, lens, 32 ** -0.5, window),
                                   atol=tol, rtol=tol)


PROMPTS = [[5, 9, 13, 2, 8], [7], list(range(20, 61)), [3, 4] * 9]


def test_end_to_end_embed_and_classify(folders: Callable[..., Path]) -> None:
    """An embedder folder without a sentence-transformers config: CLS pooled and normalized; a mean-pooling
    classifier: softmax of transformers' logits."""
    from pagedllm import LLM

    path = folders()
    ref_model = reference(path)
    llm = LLM(str(path), dtype="float32")
    try:
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        for ids, out in zip(PROMPTS, outs):
            with torch.no_grad():
                want = torch.nn.functional.normalize(ref_model(torch.tensor([ids])).last_hidden_state[0, 0], dim=0)
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-4, rtol=1e-4)
    finally:
        llm.shutdown()
    path = folders("ForSequenceClassification", num_labels=3, classifier_pooling="mean")
    ref_model = reference(path, "ForSequenceClassification")
    llm = LLM(str(path), dtype="float32")
    try:
        outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        for ids, out in zip(PROMPTS, outs):
            with torch.no_grad():
                want = ref_model(torch.tensor([ids])).logits[0].softmax(-1)
            torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=1e-4, rtol=1e-4)
    finally:
        llm.shutdown()


def test_bf16_embed_with_the_step_padded_for_the_matmuls(folders: Callable[..., Path]) -> None:
    """bfloat16 through the engine, inputs long enough that a step is padded to the matmuls' row count where
    oneDNN runs them (one sequence of padding, dropped before pooling): CLS vectors within cosine 0.999 of
    transformers' float32 ones."""
    from pagedllm import LLM

    path = folders()
    ref_model = reference(path)
    prompts = [p * 3 for p in PROMPTS]  # 195 tokens in one step
    llm = LLM(str(path), dtype="bfloat16")
    try:
        model = model_of(llm)
        assert model.layers[0].attn.Wqkv.rows_for(195) >= 195
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        for ids, out in zip(prompts, outs):
            with torch.no_grad():
                want = ref_model(torch.tensor([ids])).last_hidden_state[0, 0]
            got = torch.tensor(out.outputs.embedding)
            assert torch.nn.functional.cosine_similarity(got, want, dim=0) >= 0.999
    finally:
        llm.shutdown()
