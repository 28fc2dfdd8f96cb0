"""LLM(attention_backend="triton") on a tiny random Llama, under Triton's interpreter, against the
torch backend: the same greedy tokens. Run by tests/attention/test_triton_backend.py in a subprocess.

    TRITON_INTERPRET=1 python -m tests.attention.triton_llm_check MODEL_DIR
"""
from __future__ import annotations

import os
import sys

from pagedllm import LLM, SamplingParams

if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    prompts = [{"prompt_token_ids": [1 + i, 50 + 7 * i, 9, 300 + i, 17, 2 * i + 3] * (1 + i % 3)} for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = {}
    for backend in ("torch", "triton"):  # chunked prompts too: a 16-token budget splits the longer ones
        llm = LLM(sys.argv[1], dtype="float32", attention_backend=backend, max_num_batched_tokens=16,
                  num_kv_blocks=64, block_size=16)
        got[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        print(backend, got[backend], flush=True)
    assert got["torch"] == got["triton"], "greedy tokens differ"
    print("ALL OK")
