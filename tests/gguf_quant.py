"""Quantized GGUF files for tests: a float32 GGUF (from llama.cpp's converter) rewritten by the gguf
package with its matrices in Q8_0 / Q4_0 / Q4_1 (the package's own quantizers) or Q4_K / Q6_K (simple
quantizers here: the package has only their decoders, against which ``test_quantizers_round_trip``
checks these)."""
from __future__ import annotations

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


def _q4_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float32 -> Q4_K blocks (rows, cols / 256 * 144): per 32 values value = d sc q - dmin m,
    sc and m 6-bit, q 4-bit."""
    rows = x.shape[0]
    sb = x.reshape(-1, 8, 32)  # (super-blocks, 8 sub-blocks, 32)
    lo = np.minimum(sb.min(-1), 0)  # (super-blocks, 8): the offsets subtract
    scale = (sb.max(-1) - lo) / 15
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.where(d > 0, np.round(scale / np.where(d > 0, d, 1)), 0).clip(0, 63).astype(np.uint8)
    m = np.where(dmin > 0, np.round(-lo / np.where(dmin > 0, dmin, 1)), 0).clip(0, 63).astype(np.uint8)
    step = (d * sc)[..., None]
    q = np.where(step > 0, np.round((sb + (dmin * m)[..., None]) / np.where(step > 0, step, 1)), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)  # (super-blocks, pair, low / high, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    s = np.empty((sb.shape[0], 12), np.uint8)  # 6-bit scales and mins of sub-blocks 0-3 whole, 4-7 split
    s[:, :4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    s[:, 8:] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), dmin.astype(np.float16).view(np.uint8), s, qs],
                         axis=1)  # (super-blocks, 144)
    return out.reshape(rows, -1)


def quantize_matrix(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.Q6_K:
        return _q6_k(x.astype(np.float32))
    if qtype == GGMLQuantizationType.Q4_K:
        return _q4_k(x.astype(np.float32))
    return quantize(x.astype(np.float32), qtype)


def requantize(src: Path, dst: Path, qtype: GGMLQuantizationType, keep_float: tuple[str, ...] = ()) -> Path:
    """Copy the GGUF file ``src`` to ``dst`` with every matrix whose width fits ``qtype``'s blocks in that
    format (those named in ``keep_float`` and the rest as they were)."""
    from gguf.constants import GGML_QUANT_SIZES

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    block = GGML_QUANT_SIZES[qtype][0]
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if data.ndim == 2 and data.shape[1] % block == 0 and not any(k in tensor.name for k in keep_float):
            writer.add_tensor(tensor.name, quantize_matrix(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
