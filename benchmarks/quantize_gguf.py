"""Quantize a GGUF file with llama.cpp's own quantizer (run with the llama-cpp peer's Python):

    ../shared/peers/llama-cpp python benchmarks/quantize_gguf.py SRC.BF16.gguf DST.Q8_0.gguf --type Q8_0

Used by benchmarks/isa_levels.py to make the Q8_0 copy of the default model it times llama.cpp on.
"""
import argparse
import ctypes

import llama_cpp as L

ap = argparse.ArgumentParser()
ap.add_argument("src")
ap.add_argument("dst")
ap.add_argument("--type", default="Q8_0", help="a llama.cpp file type: Q8_0, Q4_0, Q4_K_M, ...")
args = ap.parse_args()
params = L.llama_model_quantize_default_params()
params.ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{args.type.upper()}")
params.nthread = 2
rc = L.llama_model_quantize(args.src.encode(), args.dst.encode(), ctypes.byref(params))
raise SystemExit(f"llama_model_quantize returned {rc}" if rc else 0)
