"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py, fetched by `make`: see
tests/tools/fetch_gguf_converter.sh) from tiny random transformers models — Llama (q/k rows permuted),
Qwen3, GPT-2, and the mixtures of experts (Mixtral as llama.cpp's "llama" with experts, Qwen2-MoE; each
expert's matrices stacked in one tensor) — loaded by us: the same greedy tokens as transformers on the
original weights. The reference GGUF layout is llama.cpp's, not ours."""
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
from tests.conftest import save_tiny_model
from tests.models.test_family_greedy import hf_greedy

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
@pytest.mark.parametrize("variant", ["llama-gqa-untied", "qwen3-qk-norm", "gpt2", "mixtral", "qwen2-moe"])
def test_llama_cpp_gguf_matches_transformers(variant: str, tokenizer: Any, tmp_path: Path) -> None:
    """The default model's tokenizer (one llama.cpp's converter knows) on a tiny model of each family (its
    Qwen2 converter does not know this tokenizer: Qwen2 GGUF is covered by the same code as Llama's and Qwen3's)."""
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
    arch = llm.llm_engine.executor.worker.arch.architecture
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert arch == json.loads((hf_dir / "config.json").read_text())["architectures"][0]
