"""The compiled CPU kernels (``pagedllm/csrc``, built per instruction-set level by
``pagedllm.platform``), called through ctypes with torch tensors.

GEMM over weights packed at load, fused add+RMSNorm, rotary, SiLU-and-mul, the sampler's
inverse-CDF draw, K/V slot writes and paged attention, for float32, bfloat16 and float16
storage with float32 arithmetic. A decode step of SmolLM2-135M at 256 sequences spent ~15 ms of
~157 ms in the torch ops of RMSNorm, rotary and SiLU-and-mul (chains of 4-8 ops, each reading
and writing the whole activation); the fused ops read each element once and round where torch
rounds, so the layers' torch expressions (which serve where there are no kernels) agree with them.

A call costs ~1-2 us of Python (ctypes with argtypes set once); the kernels release the GIL.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from pagedllm import platform


class QuantMatrix(Protocol):
    """What the quantized kernels read of a matrix in a GGUF format (layers/quant.py's QuantTensor)."""

    qtype: int
    rows: int
    cols: int
    data: torch.Tensor
    packed: bool
    level: str | None


Q = TypeVar("Q", bound=QuantMatrix)

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""Storage dtypes the kernels take, and their codes in the C interface."""

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "pl_gemm_layout": [_I32, ctypes.POINTER(_I64), ctypes.POINTER(_I64), ctypes.POINTER(_I64), ctypes.POINTER(_I32)],
    "pl_gemm_pack": [_P, _P, _I64, _I64, _I32, _I32],
    "pl_gemm": [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I32, _I32, _I32],
    "pl_amx_gemm": [_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I32],
    "pl_rms_norm": [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _F32, _I32, _I32],
    "pl_layer_norm": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _F32, _I32, _I32],
    "pl_rotary": [_P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I32, _I32],
    "pl_silu_and_mul": [_P, _I64, _P, _I64, _I64, _I64, _I32, _I32],
    "pl_sample": [_P, _I64, _P, _P, _P, _I64, _I64, _I32, _I32],
    "pl_argmax": [_P, _I64, _P, _I64, _I64, _I32, _I32],
    "pl_paged_attention": [_P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _I32, _I32],
    "pl_paged_attention_window": [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _F32,
                                  _I32, _I32, _I32],
    "pl_write_kv": [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _I32],
    "pl_paged_attention_i8": [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _F32, _F32,
                              _I32, _I32, _I32],
    "pl_write_kv_i8": [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I32, _I32],
    "pl_llama_stack": [_P, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _I32],
    "pl_qtype_layout": [_I32, ctypes.POINTER(_I64), ctypes.POINTER(_I64), ctypes.POINTER(_I32)],
    "pl_qpack": [_P, _P, _I64, _I64, _I32, _I32],
    "pl_qgemm": [_P, _I64, _P, _I32, _P, _I64, _I64, _I64, _I64, _I32, _I32, _I32],
    "pl_qrows": [_P, _I32, _P, _I64, _I64, _I64, _I32, _P, _I32, _I32],
    "pl_encoder_attention": [_P, _I64, _P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _F32, _I64, _I64, _I32, _I32,
                             _I32],
}


@dataclass(frozen=True)
class GemmLayout:
    """How pl_gemm_pack lays out a weight of one dtype at this level."""

    block: int
    """Output features per packed block."""
    lanes: int
    """out_features must be a multiple of this."""
    silu_group: int
    """Gate (then up) features alternating in a gate_up weight packed for the fused SiLU."""
    even_k: bool
    """in_features must be even."""


def _cache_dims(cache: torch.Tensor, head_dim: int) -> tuple[int, int, int, int]:
    """(blocks, kv_heads, block_size, head_dim) of one layer's K or V cache: (blocks, kv_heads, block_size,
    head_dim) values, or int8 (blocks, kv_heads, block_size * (head_dim + 2)) bytes."""
    if cache.dtype == torch.int8:
        blocks, nkv, nbytes = cache.shape
        assert nbytes % (head_dim + 2) == 0, "an int8 cache holds block_size * (head_dim + 2) bytes per head"
        return blocks, nkv, nbytes // (head_dim + 2), head_dim
    blocks, nkv, bs, d = cache.shape
    assert d == head_dim
    return blocks, nkv, bs, d


_SPLIT_MODES = {None: 0, False: 1, True: 2}
"""paged_attention's ``split`` as the kernels' SplitMode (csrc/attention.h): automatic, never, always."""
_NO_TILES = 4
"""Or-ed into the SplitMode: prompt rows attend row by row (csrc/attention.h's kNoTiles)."""
AMX_GEMM_ROWS = 32
"""The most rows ``amx_gemm`` takes (csrc/gemm_amx.cpp's kAmxGemmRows)."""
_AMX_TILES = 8
"""Or-ed into the SplitMode: bfloat16 prompt tiles may run on AMX tiles (csrc/attention.h's kAmxTiles)."""


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CpuKernels:
    """Typed wrappers over one loaded kernel library. Shapes are checked with asserts (callers are
    the engine's own layers); a kernel's own error (a position outside the rotary table, a slot
    outside the cache) raises RuntimeError with its message, and nothing is written."""

    def __init__(self, library: platform.KernelLibrary, amx: bool = False) -> None:
        """``amx``: the kernels of the "amx" level (the avx512_bf16 library, whose encoder attention then runs
        bfloat16 on AMX tiles)."""
        self.level = library.level
        self.amx = amx
        self._lib = library.lib
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self._lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        self._lib.pl_last_error.restype = ctypes.c_char_p
        self._lib.pl_qpack_size.argtypes, self._lib.pl_qpack_size.restype = [_I32, _I64, _I64], _I64
        prompt_tiles = self._lib.pl_attention_prompt_tiles
        prompt_tiles.argtypes, prompt_tiles.restype = [_P, _I64, _P, _P, _I64, _I64, _I64, _I64], _I64
        split_pieces = self._lib.pl_attention_split_pieces
        split_pieces.argtypes, split_pieces.restype = [_P, _P, _I64, _I64, _I64, _I32, _I32], _I64
        self._layouts = {dtype: self._layout(code) for dtype, code in DTYPE_CODES.items()}

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise RuntimeError(self._lib.pl_last_error().decode())

    def _layout(self, code: int) -> GemmLayout:
        block, lanes, group, even = _I64(), _I64(), _I64(), _I32()
        self._check(self._lib.pl_gemm_layout(code, block, lanes, group, even))
        return GemmLayout(block.value, lanes.value, group.value, bool(even.value))

    def gemm_layout(self, dtype: torch.dtype) -> GemmLayout:
        return self._layouts[dtype]

    def gemm_suits(self, weight: torch.Tensor) -> bool:
        """True for a 2-D CPU weight whose shape and dtype the GEMM packs."""
        if weight.dim() != 2 or not platform.is_cpu(weight.device) or weight.dtype not in DTYPE_CODES:
            return False
        layout = self._layouts[weight.dtype]
        out_features, in_features = weight.shape
        return out_features % layout.lanes == 0 and (in_features % 2 == 0 or not layout.even_k) and in_features > 0

    def gemm_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """(out, in) weight -> the packed 1-D copy ``gemm`` reads."""
        w = weight.detach().contiguous()
        out = torch.empty(w.numel(), dtype=w.dtype)
        self._check(self._lib.pl_gemm_pack(w.data_ptr(), out.data_ptr(), w.shape[0], w.shape[1], DTYPE_CODES[w.dtype],
                                           torch.get_num_threads()))
        return out

    def gemm(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None,
             silu_and_mul: bool) -> torch.Tensor:
        """x (..., in) W^T + bias -> (..., out); with ``silu_and_mul`` (..., out / 2) silu(gate) * up."""
        x2 = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, x.shape[-1]).contiguous()  # (rows, in)
        rows, k = x2.shape
        assert x.dtype == packed.dtype and packed.numel() == out_features * k
        cols = out_features // 2 if silu_and_mul else out_features
        out = torch.empty(rows, cols, dtype=x.dtype)  # (rows, cols)
        bias_f = None if bias is None else bias.float().contiguous()
        self._check(self._lib.pl_gemm(x2.data_ptr(), x2.stride(0), packed.data_ptr(), _ptr(bias_f), out.data_ptr(),
                                      cols, rows, out_features, k, DTYPE_CODES[x.dtype], int(silu_and_mul),
                                      torch.get_num_threads()))
        return out if x.dim() == 2 else out.view(*x.shape[:-1], cols)  # (..., cols)

    def qpack(self, w: Q) -> Q:
        """W in the layout the kernels read fastest: the packed copy for the formats they pack (Q4_0, Q4_1,
        Q8_0: csrc/quant.cpp; Q4_K, Q5_K, Q6_K: csrc/quant_k.cpp), else W itself."""
        block, nbytes, packs = _I64(), _I64(), _I32()
        self._check(self._lib.pl_qtype_layout(w.qtype, block, nbytes, packs))
        if w.packed or not packs.value:
            return w
        out = torch.empty(self._lib.pl_qpack_size(w.qtype, w.rows, w.cols), dtype=torch.uint8)
        rc = self._lib.pl_qpack(w.data.contiguous().data_ptr(), out.data_ptr(), w.rows, w.cols, w.qtype,
                                torch.get_num_threads())
        if rc == 1:  # a value the packed layout cannot hold (a Q8_0 scale beyond 511 under VNNI): rows as they are
            return w
        self._check(rc)
        return dataclasses.replace(w, data=out, packed=True, level=self.level)

    def qpacked_bytes(self, qtype: int, rows: int, cols: int) -> int:
        """Bytes ``qpack`` makes of a (rows, cols) matrix of ``qtype``: its packed copy's, or the file's where the
        rows stay as they are (the fits-in-memory check's figure, worker/memory_fit.py)."""
        block, nbytes, packs = _I64(), _I64(), _I32()
        self._check(self._lib.pl_qtype_layout(qtype, block, nbytes, packs))
        if not packs.value:
            return rows * (cols // block.value) * nbytes.value
        return int(self._lib.pl_qpack_size(qtype, rows, cols))

    def qgemm(self, x: torch.Tensor, w: QuantMatrix, out: torch.Tensor) -> None:
        """out (rows, w.rows; rows may be strided, e.g. a column slice) = x (rows, w.cols) W^T, W in its
        GGUF format (layers/quant.py), packed or not; x's values quantized to int8 per 32 on the way."""
        assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] == w.cols and x.dtype == out.dtype
        assert out.shape == (x.shape[0], w.rows) and out.stride(1) == 1 and w.data.is_contiguous()
        if w.packed and w.level != self.level:
            raise RuntimeError(f"a weight packed by the {w.level} kernels cannot run on the {self.level} ones")
        self._check(self._lib.pl_qgemm(x.data_ptr(), x.stride(0), w.data.data_ptr(), int(w.packed), out.data_ptr(),
                                       out.stride(0), x.shape[0], w.rows, w.cols, w.qtype, DTYPE_CODES[x.dtype],
                                       torch.get_num_threads()))

    def amx_gemm(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
        """out (rows, N) = x (rows, K) W^T on AMX tiles, W the plain (N, K) bfloat16 weight (csrc/gemm_amx.cpp): at
        most AMX_GEMM_ROWS rows, K a multiple of 32, N of 16; the "amx" level only."""
        assert self.amx and x.dtype == weight.dtype == out.dtype == torch.bfloat16
        assert x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous() and out.stride(1) == 1
        assert x.shape[1] == weight.shape[1] and out.shape == (x.shape[0], weight.shape[0])
        self._check(self._lib.pl_amx_gemm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
                                          x.shape[0], weight.shape[0], weight.shape[1], torch.get_num_threads()))

    def qrows(self, w: QuantMatrix, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the quantized table (packed or not), dequantized: (len(ids), w.cols) of ``dtype``."""
        ids = ids.to(torch.int64).contiguous()
        if w.packed and w.level != self.level:
            raise RuntimeError(f"a table packed by the {w.level} kernels cannot be read by the {self.level} ones")
        out = torch.empty(ids.numel(), w.cols, dtype=dtype)  # (ids, cols)
        self._check(self._lib.pl_qrows(w.data.data_ptr(), int(w.packed), ids.data_ptr(), ids.numel(), w.rows, w.cols,
                                       w.qtype, out.data_ptr(), DTYPE_CODES[dtype], torch.get_num_threads()))
        return out

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
                 eps: float) -> None:
        """out = norm(x), or residual <- x + residual and out = norm(residual); (rows, hidden) each."""
        assert x.dim() == 2 and x.stride(1) == 1 and out.shape == x.shape and out.stride(1) == 1
        assert weight.is_contiguous() and weight.dtype == x.dtype and out.dtype == x.dtype
        if residual is not None:
            assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype
        self._check(self._lib.pl_rms_norm(x.data_ptr(), x.stride(0), _ptr(residual),
                                          0 if residual is None else residual.stride(0), weight.data_ptr(),
                                          out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps,
                                          DTYPE_CODES[x.dtype], torch.get_num_threads()))

    def layer_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> torch.Tensor:
        """LayerNorm(x + residual) of x (rows, hidden) (row strides as they are) -> a new (rows, hidden) tensor;
        the sum rounded to x's dtype as torch's ``x + residual`` is."""
        rows, h = x.shape
        assert x.stride(1) == 1 and weight.shape == bias.shape == (h,)
        assert weight.is_contiguous() and bias.is_contiguous()
        assert residual is None or (residual.shape == x.shape and residual.stride(1) == 1
                                    and residual.dtype == x.dtype)
        assert weight.dtype == bias.dtype == x.dtype
        out = torch.empty(rows, h, dtype=x.dtype)
        self._check(self._lib.pl_layer_norm(x.data_ptr(), x.stride(0), _ptr(residual),
                                            0 if residual is None else residual.stride(0), weight.data_ptr(),
                                            bias.data_ptr(), out.data_ptr(), h, rows, h, eps, DTYPE_CODES[x.dtype],
                                            torch.get_num_threads()))
        return out

    def rotary_inplace(self, positions: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """Rotates the q and k heads of packed qkv rows (tokens, (heads + 2 kv_heads) * head_dim) in place."""
        assert qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] >= (num_heads + num_kv_heads) * head_dim
        assert positions.dtype == torch.int64 and positions.is_contiguous() and positions.numel() == qkv.shape[0]
        assert cos.is_contiguous() and sin.is_contiguous() and cos.dtype == qkv.dtype == sin.dtype
        self._check(self._lib.pl_rotary(positions.data_ptr(), qkv.data_ptr(), qkv.stride(0), cos.data_ptr(),
                                        sin.data_ptr(), qkv.shape[0], num_heads + num_kv_heads, head_dim, cos.shape[0],
                                        DTYPE_CODES[qkv.dtype], torch.get_num_threads()))

    def silu_and_mul(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """x (rows, 2d) packed [gate, up] -> out (rows, d) = silu(gate) * up."""
        assert x.dim() == 2 and out.dim() == 2 and x.shape[1] == 2 * out.shape[1] and x.shape[0] == out.shape[0]
        assert x.stride(1) == 1 and out.stride(1) == 1 and x.dtype == out.dtype
        self._check(self._lib.pl_silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0],
                                              out.shape[1], DTYPE_CODES[x.dtype], torch.get_num_threads()))

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
        """One inverse-CDF draw per row of (rows, vocab) logits at ``temperature`` (None: 1); u in (0, 1]."""
        assert logits.dim() == 2 and logits.stride(1) == 1 and u.dtype == torch.float32 and u.is_contiguous()
        rows = logits.shape[0]
        assert u.numel() == rows
        temp = None if temperature is None else temperature.to(torch.float32).contiguous()
        assert temp is None or temp.numel() == rows
        out = torch.empty(rows, dtype=torch.int64)
        self._check(self._lib.pl_sample(logits.data_ptr(), logits.stride(0), _ptr(temp), u.data_ptr(), out.data_ptr(),
                                        rows, logits.shape[1], DTYPE_CODES[logits.dtype], torch.get_num_threads()))
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's index of its largest logit (the first of equal ones, as torch.argmax)."""
        assert logits.dim() == 2 and logits.stride(1) == 1
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._check(self._lib.pl_argmax(logits.data_ptr(), logits.stride(0), out.data_ptr(), logits.shape[0],
                                        logits.shape[1], DTYPE_CODES[logits.dtype], torch.get_num_threads()))
        return out

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """k, v (tokens, kv_heads, head_dim), possibly strided views of the qkv output, into their
        slots of the (blocks, kv_heads, block_size, head_dim) caches; K pair-interleaved per block. Int8
        caches (blocks, kv_heads, block_size * (head_dim + 2)) get them quantized (``attention/kv_quant.py``)."""
        blocks, nkv, bs, d = _cache_dims(key_cache, k.shape[-1])
        assert key_cache.is_contiguous() and value_cache.is_contiguous() and value_cache.shape == key_cache.shape
        assert k.shape == v.shape and k.shape[1:] == (nkv, d) and k.stride(2) == 1 and v.stride(2) == 1
        assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.numel() == k.shape[0]
        if key_cache.dtype == torch.int8:
            assert k.dtype == v.dtype and value_cache.dtype == torch.int8
            self._check(self._lib.pl_write_kv_i8(
                k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), key_cache.data_ptr(),
                value_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], nkv, bs, d, blocks, DTYPE_CODES[k.dtype],
                torch.get_num_threads()))
            return
        assert k.dtype == v.dtype == key_cache.dtype == value_cache.dtype and k.element_size() in (2, 4)
        self._check(self._lib.pl_write_kv(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
                                          v.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
                                          slot_mapping.data_ptr(), k.shape[0], nkv, bs, d, blocks, k.element_size(),
                                          torch.get_num_threads()))

    @property
    def attention_flags(self) -> int:
        """What paged attention or-s into its split mode at this level: AMX tiles for bf16 prompt tiles at "amx"."""
        return _AMX_TILES if self.amx else 0

    def paged_attention(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        tables: torch.Tensor, lens: torch.Tensor, out: torch.Tensor, scale: float,
                        starts: torch.Tensor | None = None, softcap: float | None = None,
                        split: bool | None = None, tiles: bool = True) -> None:
        """q (rows, heads, head_dim; rows may be strided) attends to positions [starts[row], lens[row])
        of its block table row (from 0 without ``starts``: a sliding window otherwise), scores capped at
        ``softcap`` (cap * tanh(score / cap)) if given; out (rows, heads, head_dim) contiguous.
        ``split``: None lets the kernel split long (row, KV head) tasks over their KV blocks when they are
        too few for the threads (split-KV); False never splits, True splits whatever is long enough.
        ``tiles``: consecutive rows of one prompt attend in tiles that read each K/V block once for all of
        them (the same numbers as row by row); False keeps every row apart (the tests' reference)."""
        rows, nh, d = q.shape
        blocks, nkv, bs, _ = _cache_dims(key_cache, d)
        int8 = key_cache.dtype == torch.int8
        assert q.stride(2) == 1 and q.stride(1) == d and out.is_contiguous() and out.shape == q.shape
        assert key_cache.is_contiguous() and value_cache.is_contiguous() and q.dtype == out.dtype
        assert value_cache.dtype == key_cache.dtype and (int8 or q.dtype == key_cache.dtype)
        assert tables.dtype == lens.dtype == torch.int32 and tables.is_contiguous() and lens.is_contiguous()
        assert tables.shape[0] == rows == lens.shape[0]
        assert starts is None or (starts.dtype == torch.int32 and starts.is_contiguous() and starts.shape == lens.shape)
        attend = self._lib.pl_paged_attention_i8 if int8 else self._lib.pl_paged_attention_window
        self._check(attend(
            q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
            lens.data_ptr(), _ptr(starts), out.data_ptr(), rows, nh, nkv, bs, d, scale, softcap or 0.0,
            DTYPE_CODES[q.dtype], torch.get_num_threads(), _SPLIT_MODES[split] | (0 if tiles else _NO_TILES)
            | self.attention_flags))

    def attention_prompt_tiles(self, tables: torch.Tensor, lens: torch.Tensor, heads: int, kv_heads: int,
                               block_size: int, starts: torch.Tensor | None = None) -> int:
        """How many tiles of more than one prompt row paged_attention would form for these rows (0: every row
        attends alone)."""
        assert tables.dtype == lens.dtype == torch.int32 and tables.is_contiguous() and lens.is_contiguous()
        return self._lib.pl_attention_prompt_tiles(tables.data_ptr(), tables.shape[1], lens.data_ptr(), _ptr(starts),
                                                   lens.numel(), heads, kv_heads, block_size)

    def attention_split_pieces(self, lens: torch.Tensor, kv_heads: int, block_size: int,
                               starts: torch.Tensor | None = None, split: bool | None = None) -> int:
        """How many pieces of split tasks paged_attention would compute for rows of these lengths (and
        window starts) at torch's thread count: 0 when no (row, KV head) task is split."""
        assert lens.dtype == torch.int32 and lens.is_contiguous()
        assert starts is None or (starts.dtype == torch.int32 and starts.is_contiguous() and starts.shape == lens.shape)
        return self._lib.pl_attention_split_pieces(lens.data_ptr(), _ptr(starts), lens.numel(), kv_heads, block_size,
                                                   torch.get_num_threads(), _SPLIT_MODES[split])

    def encoder_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                          scale: float, window: int | None = None, longest: int = 0) -> torch.Tensor:
        """Bidirectional attention over whole sequences one after the other (encoder-only models): q, k, v
        (tokens, heads, head_dim; any token stride, head_dim a multiple of 32), ``starts`` (sequences + 1,) int32
        the first token of each sequence and then the token count; each token attends to every token of its
        sequence, or with ``window`` to those at most ``window`` positions away -> (tokens, heads, head_dim).
        With ``longest`` > 0, the rows of longer sequences are left unwritten (for the caller to fill)."""
        tokens, nh, d = q.shape
        assert k.shape == v.shape == q.shape and q.dtype == k.dtype == v.dtype, (q.shape, k.shape, v.shape)
        for x in (q, k, v):
            assert x.stride(2) == 1 and x.stride(1) == d, x.stride()
        assert starts.dtype == torch.int32 and starts.is_contiguous() and starts.dim() == 1
        out = torch.empty(tokens, nh, d, dtype=q.dtype)
        self._check(self._lib.pl_encoder_attention(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), out.data_ptr(),
            starts.data_ptr(), starts.numel() - 1, nh, d, scale, -1 if window is None else window, longest,
            int(self.amx), DTYPE_CODES[q.dtype], torch.get_num_threads()))
        return out

    def llama_stack(self, plan: int, hidden: torch.Tensor, residual: torch.Tensor, work: torch.Tensor,
                    positions: torch.Tensor, slot_mapping: torch.Tensor, tables: torch.Tensor,
                    lens: torch.Tensor) -> None:
        """Every decoder layer and the final norm on hidden (rows, hidden) in place (models/cpu_stack.py)."""
        rows = hidden.shape[0]
        assert hidden.is_contiguous() and residual.shape == hidden.shape and work.shape[0] == rows
        assert positions.dtype == slot_mapping.dtype == torch.int64
        assert positions.numel() == slot_mapping.numel() == rows
        assert tables.dtype == lens.dtype == torch.int32 and tables.is_contiguous() and tables.shape[0] == rows
        self._check(self._lib.pl_llama_stack(plan, rows, hidden.data_ptr(), residual.data_ptr(), work.data_ptr(),
                                             positions.data_ptr(), slot_mapping.data_ptr(), tables.data_ptr(),
                                             tables.shape[1], lens.data_ptr(), torch.get_num_threads()))


def kernels(level: str | None = None) -> CpuKernels | None:
    """The kernels of ``level`` (default: the process's level), or None where there are none."""
    return _kernels(level or platform.isa_level())


@functools.cache
def _kernels(level: str) -> CpuKernels | None:  # one object per level: layers compare them by identity
    library = platform.kernel_library(level)
    return None if library is None else CpuKernels(library, amx=level == "amx" and library.level == "avx512_bf16")


_torch_only = False

use_level = platform.use_level
"""Re-exported: the level override is the platform's (``platform.use_level``)."""
active_level = platform.active_level
"""Re-exported: ``platform.active_level``, the level ``active()`` is asked for."""


def active() -> CpuKernels | None:
    """The kernels of the active level (``platform.active_level``: the process's, or the one ``use_level`` set)."""
    return kernels(platform.active_level())


@contextlib.contextmanager
def torch_ops_only() -> Iterator[None]:
    """Layers built (or bound) inside take their torch expressions (A/B timings; tests call ``forward_native``)."""
    global _torch_only
    before, _torch_only = _torch_only, True
    try:
        yield
    finally:
        _torch_only = before


def kernels_for(device: torch.device | str, dtype: torch.dtype | None = None) -> CpuKernels | None:
    """The kernels a layer on ``device`` running ``dtype`` (None: any of DTYPE_CODES) binds: the active level's
    where ``device`` is the CPU, the kernels exist and are on (PAGEDLLM_FUSED_OPS), outside ``torch_ops_only``;
    else None (its torch expressions serve). Asked once per layer, when the model loads (layers/custom_op.py)."""
    if _torch_only or not platform.is_cpu(device) or (dtype is not None and dtype not in DTYPE_CODES):
        return None
    if not platform.switches().fused_ops:
        return None
    return active()


def fused_ops(x: torch.Tensor) -> CpuKernels | None:
    """``kernels_for`` the device and dtype of ``x`` (a weight being packed or kept quantized at load)."""
    return kernels_for(x.device, x.dtype)
