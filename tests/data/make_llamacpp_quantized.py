"""Writes the llama.cpp-quantized tiny Llama fixtures tests/data/tiny-llama-{Q4_K_M,Q5_K_M}.gguf, read by
tests/models/test_gguf_llamacpp_quantized.py. Run from the repository root, with llama.cpp's converter fetched
(`make` does it: .venv/llama-cpp-converter) and the llama-cpp peer set up (../shared/peers/llama-cpp setup):

    .venv/bin/python tests/data/make_llamacpp_quantized.py

What it does: a random Llama (seed 0, weights' std 0.05; hidden 256, intermediate 512, 2 layers, 4 heads / 2 KV
heads, untied LM head: every matrix width a multiple of the K-quants' 256-value super-block) with a SentencePiece
tokenizer of 320 pieces is saved by transformers, converted to a float32 GGUF by llama.cpp's convert_hf_to_gguf.py,
and that file quantized by llama.cpp's own llama_model_quantize (benchmarks/quantize_gguf.py in the peer's Python) to
each file type, llama.cpp choosing each tensor's format as it does for real models: Q4_K_M gives Q4_K, Q5_K_M Q5_K,
both Q6_K for the LM head and the last layer's attn_v and ffn_down (a Q6_K file would add no format). CI cannot build
llama.cpp, so the outputs (833,344 and 970,560 bytes) are committed; this script is how they were made, the same
bytes each run. LLAMA_CPP_PEER names another peer launcher.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.models.test_gguf_families import convert, train_sentencepiece  # noqa: E402
from tests.utils import save_tiny_model  # noqa: E402

#: The file types written, and the fixture each goes to.
FILE_TYPES = ("Q4_K_M", "Q5_K_M")
#: Weights' standard deviation. Larger weights do not make greedy tokens steadier against the int8 activations the
#: kernels use: measured, the logits' error grows faster than their spread (max error / max logit: 2% at 0.05, 4% at
#: 0.1 and 0.2, 13% at 0.3, where the sharp attention scores amplify it).
INIT_STD = 0.05


def fixture_path(file_type: str, folder: Path = ROOT / "tests" / "data") -> Path:
    """Where the fixture quantized to ``file_type`` lives."""
    return folder / f"tiny-llama-{file_type}.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--outdir", type=Path, default=ROOT / "tests" / "data", help="where the files go")
    ap.add_argument("--init-std", type=float, default=INIT_STD, help="the random weights' standard deviation")
    args = ap.parse_args()
    peer = os.environ.get("LLAMA_CPP_PEER", str(ROOT.parent / "shared" / "peers" / "llama-cpp"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        folder.mkdir()
        vocab = train_sentencepiece(folder / "tokenizer.model")
        save_tiny_model(folder, "llama-gqa-untied", vocab_size=vocab, hidden_size=256, intermediate_size=512,
                        bos_token_id=2, eos_token_id=1, initializer_range=args.init_std, seed=0)
        f32 = convert(folder, Path(tmp) / "f32.gguf")
        for file_type in FILE_TYPES:
            out = fixture_path(file_type, args.outdir)
            subprocess.run([peer, "python", str(ROOT / "benchmarks" / "quantize_gguf.py"), str(f32), str(out),
                            "--type", file_type], check=True)
            print(f"{out}: {out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
