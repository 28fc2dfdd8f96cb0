"""Quantized GGUF files for tests: a float32 GGUF (from llama.cpp's converter) rewritten by the gguf
package with its matrices in Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 (the package's own quantizers) or Q4_K / Q5_K /
Q6_K (simple quantizers here: the package has only their decoders, against which ``test_quantizers_round_trip``
checks these), one format for every matrix or a mix of them as llama.cpp's Q4_K_M picks."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize


def _q6_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float32 -> Q6_K blocks (rows, cols / 256 * 210) uint8: per 16 values a scale
    amax / 31, all scales as int8 multiples of one f16 d."""
    rows = x.shape[0]
    sb = x.reshape(-1, 16, 16)  # (super-blocks, 16 sub-blocks, 16)
    scale = np.abs(sb).max(-1) / 31  # (super-blocks, 16)
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.where(d > 0, np.round(scale / np.where(d > 0, d, 1)), 0).clip(-128, 127).astype(np.int8)
    step = d * sc  # (super-blocks, 16)
    q = np.where(step[..., None] != 0, np.round(sb / np.where(step == 0, 1, step)[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # (super-blocks, half, 128)
    ql = np.empty((q.shape[0], 2, 64), np.uint8)
    ql[..., :32] = (q[..., :32] & 0xF) | ((q[..., 64:96] & 0xF) << 4)
    ql[..., 32:] = (q[..., 32:64] & 0xF) | ((q[..., 96:] & 0xF) << 4)
    qh = (q[..., :32] >> 4) | ((q[..., 32:64] >> 4) << 2) | ((q[..., 64:96] >> 4) << 4) | ((q[..., 96:] >> 4) << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8),
                          d.astype(np.float16).view(np.uint8)], axis=1)  # (super-blocks, 210)
    return out.reshape(rows, -1)


def _k_quant(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's common part: (rows, cols) float32 -> the super-blocks' d, dmin and 12 bytes of 6-bit scales
    and mins (super-blocks, 16) uint8, and each value's q in 0..levels (super-blocks, 8 sub-blocks, 32) uint8;
    value = d sc q - dmin m per sub-block of 32."""
    sb = x.reshape(-1, 8, 32)  # (super-blocks, 8 sub-blocks, 32)
    lo = np.minimum(sb.min(-1), 0)  # (super-blocks, 8): the offsets subtract
    scale = (sb.max(-1) - lo) / levels
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.where(d > 0, np.round(scale / np.where(d > 0, d, 1)), 0).clip(0, 63).astype(np.uint8)
    m = np.where(dmin > 0, np.round(-lo / np.where(dmin > 0, dmin, 1)), 0).clip(0, 63).astype(np.uint8)
    step = (d * sc)[..., None]
    q = np.where(step > 0, np.round((sb + (dmin * m)[..., None]) / np.where(step > 0, step, 1)), 0)
    s = np.empty((sb.shape[0], 12), np.uint8)  # 6-bit scales and mins of sub-blocks 0-3 whole, 4-7 split
    s[:, :4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    s[:, 8:] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    head = np.concatenate([d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8), s], axis=1)
    return head, q.clip(0, levels).astype(np.uint8)


def _nibble_pairs(q: np.ndarray) -> np.ndarray:
    """(super-blocks, 8, 32) values 0..15 -> (super-blocks, 128) bytes: sub-block 2i in the low nibbles of bytes
    32i..32i+31, sub-block 2i + 1 in their high nibbles."""
    pairs = q.reshape(-1, 4, 2, 32)  # (super-blocks, pair, low / high, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float32 -> Q4_K blocks (rows, cols / 256 * 144): per 32 values value = d sc q - dmin m,
    sc and m 6-bit, q 4-bit."""
    head, q = _k_quant(x, 15)
    return np.concatenate([head, _nibble_pairs(q)], axis=1).reshape(x.shape[0], -1)  # (super-blocks, 144)


def _q5_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float32 -> Q5_K blocks (rows, cols / 256 * 176): as Q4_K with q 5-bit, its fifth bits in 32
    bytes after the scales (bit i of byte l: value l of sub-block i)."""
    head, q = _k_quant(x, 31)
    fifth = (q >> 4).transpose(0, 2, 1)  # (super-blocks, 32 l, 8 sub-blocks)
    qh = (fifth << np.arange(8, dtype=np.uint8)).sum(-1, dtype=np.uint8)  # (super-blocks, 32)
    return np.concatenate([head, qh, _nibble_pairs(q & 0xF)], axis=1).reshape(x.shape[0], -1)  # (super-blocks, 176)


def quantize_matrix(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.Q6_K:
        return _q6_k(x.astype(np.float32))
    if qtype == GGMLQuantizationType.Q4_K:
        return _q4_k(x.astype(np.float32))
    if qtype == GGMLQuantizationType.Q5_K:
        return _q5_k(x.astype(np.float32))
    return quantize(x.astype(np.float32), qtype)


def requantize(src: Path, dst: Path, qtype: GGMLQuantizationType, keep_float: tuple[str, ...] = ()) -> Path:
    """Copy the GGUF file ``src`` to ``dst`` with every matrix whose width fits ``qtype``'s blocks in that
    format (those named in ``keep_float`` and the rest as they were)."""
    from gguf.constants import GGML_QUANT_SIZES

    block = GGML_QUANT_SIZES[qtype][0]
    return rewrite(src, dst, lambda name, cols: qtype if cols % block == 0 and not any(k in name for k in keep_float)
                   else None)


def rewrite(src: Path, dst: Path, pick: Callable[[str, int], GGMLQuantizationType | None],
            intermediate: int | None = None) -> Path:
    """Copy the float GGUF file ``src`` to ``dst`` with each matrix in the format ``pick(its GGUF name, its width)``
    (None: as it was). With ``intermediate``, the MLP is that wide: its matrices new random ones (normal, of the
    file's own ones' scale), the metadata's feed_forward_length set."""
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        value = intermediate if intermediate and field.name.endswith(".feed_forward_length") else field.contents()
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    rng = np.random.default_rng(0)
    for tensor in reader.tensors:
        data = np.array(tensor.data)  # (out, in) for a matrix
        if intermediate and any(f".{m}." in tensor.name for m in ("ffn_gate", "ffn_up", "ffn_down")):
            shape = (data.shape[0], intermediate) if ".ffn_down." in tensor.name else (intermediate, data.shape[1])
            data = (rng.standard_normal(shape) * data.std()).astype(np.float32)
        qtype = pick(tensor.name, data.shape[1]) if data.ndim == 2 else None
        if qtype is not None:
            writer.add_tensor(tensor.name, quantize_matrix(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


_FALLBACK = {GGMLQuantizationType.Q4_K: GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_K: GGMLQuantizationType.Q5_1,
             GGMLQuantizationType.Q6_K: GGMLQuantizationType.Q8_0}
"""llama.cpp's format for a matrix whose width is not a multiple of a K-quant's 256-value super-block."""


def q4_k_m_type(name: str, cols: int, layers: int, q5_k: tuple[str, ...] = ()) -> GGMLQuantizationType:
    """The format llama.cpp's Q4_K_M quantizer gives a Llama's matrix ``name`` (GGUF's name) of ``cols`` columns
    in a model of ``layers`` layers (its llama_tensor_get_type): Q6_K for the output and for attn_v / ffn_down
    of the layers that get more bits (the first and last eighth, every third between), Q4_K for the others and
    the embedding table; a width off 256 falls back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0). Matrices named in
    ``q5_k`` get Q5_K (llama.cpp's Q4_K_M gives it to a fused attn_qkv, which a Llama file lacks)."""
    qtype = GGMLQuantizationType.Q4_K
    if name.startswith("blk."):
        i = int(name.split(".")[1])
        more_bits = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        if more_bits and ("attn_v." in name or "ffn_down." in name):
            qtype = GGMLQuantizationType.Q6_K
    elif name.startswith("output."):
        qtype = GGMLQuantizationType.Q6_K
    if any(k in name for k in q5_k):
        qtype = GGMLQuantizationType.Q5_K
    return qtype if cols % 256 == 0 else _FALLBACK[qtype]
