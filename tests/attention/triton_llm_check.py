"""LLM(attention_backend="triton") on a tiny random Llama, under Triton's interpreter, against the
torch backend: the same greedy tokens, eagerly and with the decode steps replayed from "graphs"
(a stand-in that re-runs the recorded forward on the static buffers: padding, static metadata and
the eager fallback are the CUDA-graph path's own code). Run by tests/attention/test_triton_backend.py
in a subprocess.

    TRITON_INTERPRET=1 python -m tests.attention.triton_llm_check MODEL_DIR
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch

from pagedllm import LLM, SamplingParams
from tests.utils import worker_of


class EagerGraph:
    """Stands in for a CUDA graph on a CPU: replay runs the recorded function again, reading the
    static buffers as they are then, and writes into the output the capture returned."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    prompts = [{"prompt_token_ids": [1 + i, 50 + 7 * i, 9, 300 + i, 17, 2 * i + 3] * (1 + i % 3)} for i in range(6)]
    # different lengths: decode batches of 6 (beyond the ladder: eager), 4, 3 (padded to 4), 2 and 1
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (14, 12, 10, 8, 5, 3)]
    got = {}
    for run in ("torch", "triton", "triton+graphs"):  # chunked prompts too: a 16-token budget splits the longer ones
        llm = LLM(sys.argv[1], dtype="float32", attention_backend=run.split("+")[0], max_num_batched_tokens=16,
                  num_kv_blocks=64, block_size=16)
        runner = worker_of(llm).model_runner
        if run.endswith("graphs"):
            runner.capture_model((2, 4), llm.llm_engine.config.model.max_model_len, EagerGraph)
        got[run] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        print(run, got[run], flush=True)
        if run.endswith("graphs"):
            print("graph replays per size", dict(runner.graphs.replays), flush=True)
            assert set(runner.graphs.replays) == {2, 4}, runner.graphs.replays
    assert got["torch"] == got["triton"] == got["triton+graphs"], "greedy tokens differ"
    print("ALL OK")
