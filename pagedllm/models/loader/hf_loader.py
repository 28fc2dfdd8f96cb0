"""HF folders: config.json and *.safetensors."""
from __future__ import annotations

import copy
import glob
import json
import mmap
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch

from pagedllm.errors import ValidationError
from pagedllm.models.config import ArchConfig, as_id_tuple


def read_config(folder: str) -> dict:
    """The folder's config.json as a dict."""
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def merge_hf_overrides(config: dict[str, Any], overrides: dict[str, Any], where: str = "hf_overrides") -> None:
    """``overrides`` merged into ``config`` (a config.json dict) in place, as vLLM's hf_overrides: an object merges
    into the object the config holds under that key, any other value replaces it (a key the config lacks is
    added). ValidationError naming ``where`` for a key that is not a string."""
    for key, value in overrides.items():
        if not isinstance(key, str) or not key:
            raise ValidationError.bad_value(where, key, "an object of config.json keys")
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            merge_hf_overrides(config[key], value, f"{where}.{key}")
        else:
            config[key] = copy.deepcopy(value)


def load_arch_config(folder: str) -> ArchConfig:
    return ArchConfig.from_hf(read_config(folder))


def generation_eos_token_ids(folder: str) -> tuple[int, ...]:
    """The eos_token_id entry of generation_config.json (an id or a list), if the folder has one."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        return ()
    with open(path) as f:
        return as_id_tuple(json.load(f).get("eos_token_id"))


def iter_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every safetensors file, lazily, one at a time: each a view of the file's memory map (copy
    what you keep, write into none), its pages let go when the next is asked for (``read_safetensors``)."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValidationError(f"no *.safetensors files in {folder!r}", param="model", value=folder)
    for file in files:
        yield from read_safetensors(file)


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
"""safetensors' dtype names -> torch's."""


def read_safetensors(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors in the order of their bytes, each a view of a private memory map of the file.

    Once the consumer asks for the next tensor, the pages of the one before are unmapped (madvise DONTNEED):
    a mapped page the process has read counts in its RSS (RssFile) until then, so reading a whole file through
    one map (as safetensors' own ``safe_open`` does) holds a second copy of the weights at the end of each file
    (the 1.7B shape: RSS 4.64 GiB for 3.19 GiB of weights). The pages stay in the page cache, which the kernel
    reclaims as it needs; a view kept past that point reads them again from there (nothing writes into the map,
    so nothing is lost)."""
    with open(file, "rb") as f:
        try:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        except (struct.error, ValueError):
            raise ValidationError(f"{file!r} is not a safetensors file", param="model", value=file) from None
        length = os.fstat(f.fileno()).st_size
        # ACCESS_COPY (a private map): torch.frombuffer wants a writable buffer; nothing writes into it
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    base = 8 + size
    entries = sorted(((name, info) for name, info in header.items() if name != "__metadata__"),
                     key=lambda item: item[1]["data_offsets"][0])
    for name, info in entries:
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValidationError(f"tensor {name!r} of {file!r} has dtype {info['dtype']}, which is not read",
                                  param="model", value=file)
        start, end = (base + offset for offset in info["data_offsets"])
        shape = [int(n) for n in info["shape"]]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if end > length or (end - start) != itemsize * _numel(shape):
            raise ValidationError(f"tensor {name!r} of {file!r} is cut short or mis-sized", param="model", value=file)
        if start == end:
            yield name, torch.empty(shape, dtype=dtype)
            continue
        yield name, torch.frombuffer(mapped, dtype=dtype, count=(end - start) // itemsize,
                                     offset=start).view(shape)  # (shape as in the header)
        page = start - start % mmap.PAGESIZE
        mapped.madvise(mmap.MADV_DONTNEED, page, end - page)  # this tensor's pages off our RSS (see above)


def _numel(shape: list[int]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count
