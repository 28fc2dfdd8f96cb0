"""Every ``PAGEDLLM_*`` environment variable (and the ones of others we read: SageMaker's, vLLM's, Ray's, Triton's,
the OpenAI client's, XDG's, CXX) in one place: its type, default and meaning.

Only this module reads them (``tests/test_envs.py`` checks that no other module names one, and that the
README's table lists each of them). Each user reads a variable's value where it starts (the process, a
model load, an executor), never per step: ``VARIABLE.read()`` reads the environment as it is then, or a
child's environment given as ``environ``. A value a variable cannot take is a ValidationError naming it.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pagedllm.errors import ValidationError

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class EnvVar(Generic[T]):
    """One environment variable: its name, its default (as the text it would be set to), what it does,
    and how its text becomes a value."""

    name: str
    default: str
    doc: str
    parse: Callable[[str, str], T]
    """(variable name, its text) -> its value, or a ValidationError naming the variable."""

    def read(self, environ: Mapping[str, str] | None = None) -> T:
        """The value now (set but empty, or only spaces, counts as unset)."""
        raw = (os.environ if environ is None else environ).get(self.name)
        return self.parse(self.name, raw if raw is not None and raw.strip() else self.default)


def _text(_: str, raw: str) -> str:
    return raw.strip()


def _exact(_: str, raw: str) -> str:
    return raw


def _lower(_: str, raw: str) -> str:
    return raw.strip().lower()


def _switch(_: str, raw: str) -> bool:
    """On unless "0" (an A/B switch)."""
    return raw.strip() != "0"


def _choice(*options: str, lower: bool = True) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.strip().lower() if lower else raw.strip()
        if value not in options:
            raise ValidationError.bad_value(name, raw, ", ".join(repr(o) for o in options[:-1])
                                            + f" or {options[-1]!r}")
        return value
    return parse


def _zero_or_one(name: str, raw: str) -> bool:
    value = raw.strip()
    if value not in ("0", "1"):
        raise ValidationError.bad_value(name, raw, "0 or 1")
    return value == "1"


def _truthy(_: str, raw: str) -> bool:
    """Another program's switch, read as it reads it: 1, true, yes, on or y is on, anything else off."""
    return raw.strip().lower() in ("1", "true", "yes", "on", "y")


def _true_or_false(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value not in ("0", "1", "true", "false"):
        raise ValidationError.bad_value(name, raw, "0, 1, true or false")
    return value in ("1", "true")


def _positive_seconds(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValidationError.bad_value(name, raw, "a positive number of seconds")
    return value


def _optional_positive_int(name: str, raw: str) -> int | None:
    if not raw.strip():
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValidationError.bad_value(name, raw, "a positive integer")
    return value


ISA: EnvVar[str] = EnvVar(
    name="PAGEDLLM_ISA", default="", parse=_lower,
    doc="Run the kernels of this instruction-set level (portable, avx2, avx512, avx512_bf16, amx) instead of the "
        "CPU's own; a level above the CPU's is refused. Also caps torch's own kernels when set before torch loads.")
CACHE_DIR: EnvVar[str] = EnvVar(
    name="PAGEDLLM_CACHE_DIR", default="", parse=_text,
    doc="Where compiled CPU kernels and GGUF files' converted tokenizers are cached (default "
        "$XDG_CACHE_HOME/pagedllm, else ~/.cache/pagedllm).")
FUSED_OPS: EnvVar[bool] = EnvVar(
    name="PAGEDLLM_FUSED_OPS", default="1", parse=_switch,
    doc="0: the compiled GEMM and fused ops off (torch's expressions serve; attention kernels stay), for A/B runs.")
GEMM: EnvVar[str] = EnvVar(
    name="PAGEDLLM_GEMM", default="auto", parse=_choice("auto", "onednn"),
    doc="auto: our GEMM where it suits (on AMX CPUs: AMX tiles for up to 32 rows, oneDNN for more); onednn: "
        "oneDNN's packed matmul for every bf16 matmul.")
DENSE_COPY: EnvVar[str] = EnvVar(
    name="PAGEDLLM_DENSE_COPY", default="auto", parse=_choice("auto", "1", "0"),
    doc="Weights kept in GGUF formats also get a copy in the model's dtype for steps of more rows than the "
        "quantized kernels win at (prompts, large batches). auto: at the amx level for bf16 GGUF models whose "
        "copy takes at most 1 GiB or half the memory the weights and KV pool leave; 1: always; 0: never.")
CPU_STACK: EnvVar[bool] = EnvVar(
    name="PAGEDLLM_CPU_STACK", default="1", parse=_switch,
    doc="0: the decoder layers run one by one from Python instead of in one compiled call (A/B runs).")
CPU_OMP_THREADS_BIND: EnvVar[str] = EnvVar(
    name="PAGEDLLM_CPU_OMP_THREADS_BIND", default="", parse=_text,
    doc='Cores per local tensor-parallel rank, ranks separated by "|" ("0-3|4-7"), or "all" (no binding); '
        "unset: this process's cores split evenly.")
CPU_SHM_ALLREDUCE: EnvVar[bool] = EnvVar(
    name="PAGEDLLM_CPU_SHM_ALLREDUCE", default="1", parse=_switch,
    doc="0: tensor-parallel ranks of one machine reduce over gloo instead of shared memory.")
EXECUTE_MODEL_TIMEOUT_SECONDS: EnvVar[float] = EnvVar(
    name="PAGEDLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", default="300", parse=_positive_seconds,
    doc="Seconds a step may take on a worker before the engine declares the worker hung and stops.")
RAY_PLACEMENT_STRATEGY: EnvVar[str] = EnvVar(
    name="PAGEDLLM_RAY_PLACEMENT_STRATEGY", default="PACK",
    parse=_choice("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD", lower=False),
    doc="The Ray placement group's strategy for the ranks' bundles (SPREAD or STRICT_SPREAD: across machines).")
PP_BATCHES_IN_FLIGHT: EnvVar[int | None] = EnvVar(
    name="PAGEDLLM_PP_BATCHES_IN_FLIGHT", default="", parse=_optional_positive_int,
    doc="Batches of different requests in flight through pipeline stages at once (unset: pipeline_parallel_size "
        "where each stage has nodes of its own (Ray), else 1: stages on one machine take turns on its cores).")
TRITON_DECODE_SPLITS: EnvVar[int | None] = EnvVar(
    name="PAGEDLLM_TRITON_DECODE_SPLITS", default="", parse=_optional_positive_int,
    doc="Force this many splits per sequence in the Triton decode kernel (unset: chosen to fill the GPU).")
ENABLE_MULTIPROCESSING: EnvVar[bool] = EnvVar(
    name="PAGEDLLM_ENABLE_MULTIPROCESSING", default="1", parse=_zero_or_one,
    doc="0: `pagedllm serve` runs the engine loop as a thread of the API process instead of its own process.")
API_KEY: EnvVar[str] = EnvVar(
    name="PAGEDLLM_API_KEY", default="", parse=_exact,
    doc="The API key `pagedllm serve` requires when --api-key is not given.")
ALLOW_RUNTIME_LORA_UPDATING: EnvVar[bool] = EnvVar(
    name="PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", default="0", parse=_true_or_false,
    doc="1 or true: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (as --allow-runtime-lora-updating).")
SAGEMAKER_STATEFUL_SESSIONS: EnvVar[bool] = EnvVar(
    name="SAGEMAKER_ENABLE_STATEFUL_SESSIONS", default="false", parse=_true_or_false,
    doc="SageMaker's own variable, 1 or true: /invocations opens and closes stateful sessions (as "
        "--enable-sagemaker-sessions).")
SERVER_DEV_MODE: EnvVar[bool] = EnvVar(
    name="PAGEDLLM_SERVER_DEV_MODE", default="0", parse=_true_or_false,
    doc="1 or true: `pagedllm serve` adds vLLM's development routes: /sleep, /release_kv_cache_memory, /wake_up, "
        "/is_sleeping, /pause, /resume, /is_paused and /collective_rpc (which runs any worker method: trusted "
        "networks only).")
VLLM_SERVER_DEV_MODE: EnvVar[bool] = EnvVar(
    name="VLLM_SERVER_DEV_MODE", default="0", parse=_true_or_false,
    doc="vLLM's own variable, 1 or true: as PAGEDLLM_SERVER_DEV_MODE.")
RAY_ADDRESS: EnvVar[str] = EnvVar(
    name="RAY_ADDRESS", default="", parse=_text,
    doc="Ray's own variable: the cluster that `distributed_executor_backend='ray'` and `data_parallel_backend='ray'` "
        "join (unset: they start a local one, on 127.0.0.1).")
XDG_CACHE_HOME: EnvVar[str] = EnvVar(
    name="XDG_CACHE_HOME", default="", parse=_text,
    doc="The XDG base directory for caches: pagedllm's cache is `$XDG_CACHE_HOME/pagedllm` when PAGEDLLM_CACHE_DIR "
        "is unset (default `~/.cache`).")
CXX: EnvVar[str] = EnvVar(
    name="CXX", default="", parse=_text,
    doc="The C++ compiler that builds the CPU kernels (unset: g++, else c++).")
TRITON_INTERPRET: EnvVar[bool] = EnvVar(
    name="TRITON_INTERPRET", default="0", parse=_truthy,
    doc="Triton's own variable, 1: its kernels run in its interpreter on the CPU, so the triton attention backend "
        "is available without a GPU (tests).")
OPENAI_API_KEY: EnvVar[str] = EnvVar(
    name="OPENAI_API_KEY", default="", parse=_exact,
    doc="The OpenAI client's own variable: the key `pagedllm chat` and `pagedllm complete` send when --api-key is "
        "not given.")

VARIABLES: tuple[EnvVar[Any], ...] = (
    ISA, CACHE_DIR, FUSED_OPS, GEMM, DENSE_COPY, CPU_STACK, CPU_OMP_THREADS_BIND, CPU_SHM_ALLREDUCE,
    EXECUTE_MODEL_TIMEOUT_SECONDS, RAY_PLACEMENT_STRATEGY, PP_BATCHES_IN_FLIGHT, TRITON_DECODE_SPLITS,
    ENABLE_MULTIPROCESSING, API_KEY,
    ALLOW_RUNTIME_LORA_UPDATING, SAGEMAKER_STATEFUL_SESSIONS, SERVER_DEV_MODE, VLLM_SERVER_DEV_MODE, RAY_ADDRESS,
    XDG_CACHE_HOME, CXX, TRITON_INTERPRET, OPENAI_API_KEY)
"""Every variable, in the README table's order."""
