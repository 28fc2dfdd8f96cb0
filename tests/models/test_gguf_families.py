"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py, fetched by `make`: see
tests/tools/fetch_gguf_converter.sh) from tiny random transformers models — Llama (q/k rows permuted),
Qwen2, Qwen3, GPT-2, Phi-3, Gemma 2/3, and the mixtures of experts (Mixtral as llama.cpp's "llama" with
experts, Qwen2-MoE; each expert's matrices stacked in one tensor) — loaded by us: the same greedy tokens as
transformers on the original weights. The reference GGUF layout is llama.cpp's, not ours."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.models.test_family_greedy import hf_greedy
from tests.models.test_tiny_logits import hf_logits
from tests.utils import save_tiny_model, worker_of

CONVERTER = Path(sys.prefix) / "llama-cpp-converter"


def convert(hf_dir: Path, out: Path) -> Path:
    """hf_dir -> a float32 GGUF file, by llama.cpp's converter."""
    env = {**os.environ, "PYTHONPATH": str(CONVERTER / "gguf-py")}
    done = subprocess.run([sys.executable, str(CONVERTER / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile",
                           str(out), "--outtype", "f32"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


NOT_FETCHED = "llama.cpp's converter is not fetched (`make test` runs tests/tools/fetch_gguf_converter.sh)"


@pytest.mark.skipif(not (CONVERTER / "convert_hf_to_gguf.py").exists(), reason=NOT_FETCHED)
@pytest.mark.parametrize("variant", ["llama-gqa-untied", "qwen3-qk-norm", "gpt2", "qwen2-moe"])  # qwen2-moe: MoE
def test_llama_cpp_gguf_matches_transformers(variant: str, tokenizer: Any, tmp_path: Path) -> None:
    """The default model's tokenizer (one llama.cpp's converter knows) on a tiny model of each family (its
    Qwen2 converter does not know this tokenizer: Qwen2 is converted with a SentencePiece one below)."""
    # the converter maps no dense layer of Qwen2-MoE (mlp_only_layers): every layer a mixture here
    overrides = dict(mlp_only_layers=[], num_hidden_layers=2) if variant == "qwen2-moe" else {}
    hf_dir = save_tiny_model(tmp_path / variant, variant, vocab_size=len(tokenizer), tokenizer=tokenizer, **overrides)
    if variant == "gpt2":  # the converter reads GPT-2's context length from the old n_ctx key
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**config, "n_ctx": config["n_positions"]}))
    gguf = convert(hf_dir, tmp_path / f"{variant}.gguf")
    prompts = [torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19)]
    want = [hf_greedy(str(hf_dir), p, 12) for p in prompts]
    llm = LLM(str(gguf), dtype="float32", num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    arch = worker_of(llm).arch.architecture
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert arch == json.loads((hf_dir / "config.json").read_text())["architectures"][0]


def train_sentencepiece(path: Path) -> int:
    """A small BPE SentencePiece model (as Gemma's and Phi-3's tokenizer.model) written to ``path``; its size."""
    import io
    import random

    import sentencepiece as spm

    words = ["alpha", "beta", "gamma", "delta", "paged", "block", "cache", "token", "model", "window", "river"]
    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=proto, vocab_size=320,
                                   model_type="bpe", byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                                   minloglevel=2)
    path.write_bytes(proto.getvalue())
    return spm.SentencePieceProcessor(model_proto=proto.getvalue()).vocab_size()


def hf_logprobs(path: str, prompt: list[int], tokens: list[int]) -> list[float]:
    """transformers' log-probability of each of ``tokens`` following ``prompt``."""
    logits = hf_logits(Path(path), prompt + tokens)[len(prompt) - 1:-1]  # (tokens, vocab)
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.mark.skipif(not (CONVERTER / "convert_hf_to_gguf.py").exists(), reason=NOT_FETCHED)
@pytest.mark.parametrize("variant", ["phi3-longrope", "gemma2", "gemma3", "qwen2-qkv-bias"])
def test_llama_cpp_gguf_sentencepiece_phi3_gemma_qwen2(variant: str, tokenizer: Any, tmp_path: Path) -> None:
    """Phi-3 (q|k|v and gate|up packed, LongRoPE's factors as tensors) and Gemma 2/3 (norms stored as 1 + w,
    what the file leaves out taken as llama.cpp does: the sliding layers' pattern, the score scale), with a
    SentencePiece tokenizer.model as theirs (Gemma 3: the default model's tokenizer.json, which the converter
    also takes), and Qwen2 (qkv biases; through a tokenizer.model, which its converter takes too): greedy tokens
    and their log-probabilities equal transformers'."""
    hf_dir = tmp_path / variant
    hf_dir.mkdir()
    if variant == "gemma3":  # llama.cpp assumes Gemma 3's five sliding layers in six: six layers here
        save_tiny_model(hf_dir, variant, vocab_size=len(tokenizer), tokenizer=tokenizer, num_hidden_layers=6,
                        layer_types=None, query_pre_attn_scalar=16)
    else:
        vocab = train_sentencepiece(hf_dir / "tokenizer.model")
        # Gemma 2: the file has no score scale (llama.cpp takes head_dim's) and softer caps, so tokens vary
        overrides = dict(query_pre_attn_scalar=16, final_logit_softcapping=30.0) if variant == "gemma2" else {}
        save_tiny_model(hf_dir, variant, vocab_size=vocab, bos_token_id=2, eos_token_id=1, **overrides)
    gguf = convert(hf_dir, tmp_path / f"{variant}.gguf")
    hf_config = json.loads((hf_dir / "config.json").read_text())
    top = hf_config["vocab_size"] - 1
    prompts = [torch.randint(4, top, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 19)]
    want = [hf_greedy(str(hf_dir), p, 12) for p in prompts]
    llm = LLM(str(gguf), dtype="float32", num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1), use_tqdm=False)
    arch = worker_of(llm).arch
    text = "alpha beta window"
    round_trip = llm.get_tokenizer().decode(llm.get_tokenizer().encode(text, add_special_tokens=False))
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    for prompt, out in zip(prompts, outs):
        got = [entry[t].logprob for t, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
        assert got == pytest.approx(hf_logprobs(str(hf_dir), prompt, want[prompts.index(prompt)]), abs=1e-4)
    assert arch.architecture == hf_config["architectures"][0] and round_trip == text
    if variant.startswith("qwen2"):
        return
    if variant == "phi3-longrope":
        scaling = hf_config.get("rope_parameters") or hf_config["rope_scaling"]
        assert arch.rope_scaling["long_factor"] == pytest.approx(scaling["long_factor"])
        assert arch.rope_scaling["short_factor"] == pytest.approx(scaling["short_factor"])
    else:
        assert list(arch.layer_types) == hf_config["layer_types"] and arch.sliding_window == hf_config["sliding_window"]
