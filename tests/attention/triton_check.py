"""The triton backend against the torch backend, run under Triton's interpreter in a subprocess of
tests/attention/test_triton_backend.py (TRITON_INTERPRET=1 must be set before triton is imported,
and a bad pointer then kills this process, not the test run), or compiled on a CUDA device
(benchmarks/gpu_check.sh). The reference always runs on the CPU.

    TRITON_INTERPRET=1 python -m tests.attention.triton_check [--quick]
    python -m tests.attention.triton_check            # on a CUDA machine: the kernels compiled

Prints one line per case and "ALL OK" at the end; exits 1 on the first mismatch.
"""
from __future__ import annotations

import os
import sys

import torch

from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.attention.triton_backend import SPLITS_ENV, TritonAttentionBackend
from tests.attention.batches import make_step

DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
"""Both absolute and relative (torch.allclose's atol and rtol): a bf16 output of magnitude 2 is
rounded to 1/64, so either side's rounding alone can differ by 1.6e-2 in absolute terms."""
SHAPES = [(4, 4, 64, 16), (8, 2, 64, 32), (8, 1, 128, 16), (6, 2, 128, 32), (9, 3, 64, 16)]
"""(heads, kv_heads, head_dim, block_size): MHA, GQA, MQA, group 3 (padded to 4), block sizes 16 and 32."""


def check(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, decode_only: bool,
          splits: int, window: int | None = None, softcap: float | None = None) -> tuple[float, float]:
    """(largest difference, largest difference / (tol + tol * |reference|)) between the backends'
    outputs on one random step; the written caches must be equal."""
    os.environ[SPLITS_ENV] = str(splits)
    seq_lens = [1, 5, block_size, block_size + 1, 37, 4 * block_size + 3]
    chunks = [] if decode_only else [(9, 16), (20, 20), (3, 40)]  # a chunk after a prefix, a whole prompt, a tail
    step = make_step(seq_lens, prefill=0, block_size=block_size, num_blocks=64, seed=heads * 7 + block_size,
                     chunks=chunks)
    g = torch.Generator().manual_seed(heads + head_dim)
    cache = torch.randn(TorchAttentionBackend.kv_cache_shape(64, block_size, kv_heads, head_dim), generator=g).to(dtype)
    n = step.slot_mapping.shape[0]
    # q as a view of a wider tensor (as the model's qkv split gives): strided rows
    q = torch.randn(n, heads + 2, head_dim, generator=g).to(dtype)[:, :heads]
    k = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
    results = []
    for backend, device in ((TorchAttentionBackend(), torch.device("cpu")), (TritonAttentionBackend(), DEVICE)):
        c = cache.clone().to(device)
        md = backend.make_builder().build(step)
        out = backend.forward(q.to(device), k.to(device), v.to(device), c, md, head_dim ** -0.5, window, softcap)
        results.append((out.float().cpu(), c.float().cpu()))
    (want, want_cache), (got, got_cache) = results
    assert torch.equal(want_cache, got_cache), "the K/V written into their slots differ"
    assert not torch.isnan(got).any()
    diff = (got - want).abs()
    tol = TOL[dtype]
    return diff.max().item(), (diff / (tol + tol * want.abs())).max().item()


def main() -> int:
    quick = "--quick" in sys.argv
    dtypes = [torch.float32, torch.bfloat16] if quick else [torch.float32, torch.bfloat16, torch.float16]
    for shape in SHAPES:
        for dtype in dtypes:
            for decode_only, splits in ((False, 1), (True, 1), (True, 4)):
                err, ratio = check(*shape, dtype, decode_only, splits)
                label = f"{shape} {str(dtype)[6:]} {'decode' if decode_only else 'mixed'} splits={splits}"
                print(f"{label}: max diff {err:.2e} ({ratio:.2f} of the tolerance)", flush=True)
                if ratio > 1.0:
                    print(f"MISMATCH {label}: {err:.3e} beyond atol=rtol={TOL[dtype]}")
                    return 1
    for shape in SHAPES[:2]:  # sliding windows (shorter than a block, spanning blocks) and Gemma 2's soft cap
        for window, softcap in ((7, None), (20, None), (None, 2.0)):
            for decode_only, splits in ((False, 1), (True, 4)):
                err, ratio = check(*shape, torch.float32, decode_only, splits, window, softcap)
                label = (f"{shape} float32 {'decode' if decode_only else 'mixed'} splits={splits} window={window} "
                         f"softcap={softcap}")
                print(f"{label}: max diff {err:.2e} ({ratio:.2f} of the tolerance)", flush=True)
                if ratio > 1.0:
                    print(f"MISMATCH {label}: {err:.3e} beyond atol=rtol={TOL[torch.float32]}")
                    return 1
    print("ALL OK")
    return 0


if __name__ == "__main__":
    assert DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1", "no CUDA: run under TRITON_INTERPRET=1"
    print(f"device: {DEVICE}{' (Triton interpreter)' if DEVICE.type == 'cpu' else ''}")
    sys.exit(main())
