"""A worker: one device's (one rank's) model shard, KV cache tensors and model runner."""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from tqdm.auto import tqdm

from pagedllm import platform
from pagedllm.attention import kv_quant
from pagedllm.attention.base import AttentionBackend, get_attention_backend, resolve_backend_name
from pagedllm.config import EngineConfig, ParallelConfig, default_kv_budget
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.distributed.parallel_state import (
    destroy_distributed,
    get_pp_stage,
    init_distributed,
    layer_partition,
    shard_heads,
)
from pagedllm.errors import ValidationError
from pagedllm.layers.custom_op import bind_ops
from pagedllm.layers.norm import GemmaRMSNorm
from pagedllm.layers.pooler import Pooler
from pagedllm.layers.prepack import add_dense_copies
from pagedllm.layers.quant import DENSE_ROWS, describe_quantized, int8_on_load
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora_request import LoRARequest
from pagedllm.models.config import ArchConfig
from pagedllm.models.loader import iter_weights, load_arch_config
from pagedllm.models.registry import get_model_class
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.platform import heap
from pagedllm.platform.cpu import rank_cores
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.speculator import Speculator, make_speculator
from pagedllm.worker.memory_fit import LoadMeter, dense_copy_room, weight_bytes
from pagedllm.worker.memory_plan import kv_block_bytes
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.pooling_runner import runner_for
from pagedllm.worker.sleep import sleep_worker, wake_worker
from pagedllm.worker.stage_runner import StageRunner
from pagedllm.worker.structured_output import compiler_for
from pagedllm.worker.user_calls import destroy_extension, user_call
from pagedllm.worker.watermark import GumbelWatermark

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankInfo:
    """Where a worker sits among the ranks (plain data: executors send it)."""

    rank: int = 0
    """Its rank in the group: pipeline stage x tensor_parallel_size + its tensor-parallel rank
    (ParallelConfig.answering_rank returns the sampled tokens)."""
    local_rank: int = 0
    """Its index among the ranks on the same machine (picks its cores)."""
    local_world_size: int = 1
    """Ranks on the same machine (they share its cores and memory)."""
    distributed_init_method: str | None = None
    """"tcp://host:port" of rank 0's store; None at tp=1."""
    core_share: tuple[int, int] | None = None
    """(its index, how many) among the ranks of this machine that compute at the same time, which split its cores
    (pipeline stages run one at a time: a stage's ranks split them, the stages share them); None: every local
    rank (local_rank, local_world_size)."""


class Worker:
    """One rank's model shard, KV pools and model runner, brought up in vLLM's phases.

    ``init_device`` (device, cores, process group, attention backend and its kernels), ``load_model`` (the
    weights, a draft model's, the runner around them), ``determine_num_kv_blocks`` (what fits), ``initialize_cache``
    (the KV pools), ``compile_or_warm_up_model`` (a GPU's CUDA graphs), then ``execute_model`` per step.
    ``make_worker`` (worker/extension.py) runs the first two; the engine core runs the rest through its executor.
    """

    def __init__(self, config: EngineConfig, arch: ArchConfig, eos_token_ids: tuple[int, ...],
                 rank_info: RankInfo | None = None) -> None:
        self.config = config
        self.arch = arch
        self.rank_info = rank_info or RankInfo()
        self.dtype = getattr(torch, config.model.dtype)
        self._eos_token_ids = eos_token_ids
        self.device = torch.device("cpu")
        """This rank's device (set by init_device)."""
        self.cores: list[int] | None = None
        """The cores this rank is pinned to (tensor-parallel CPU ranks), or None: all of them."""
        self.backend: AttentionBackend | None = None
        """The attention backend (chosen, its kernels built, by init_device)."""
        self.model_runner: ModelRunner | None = None
        """Made by load_model (None again while a level-2 sleep dropped it)."""
        self._kv_blocks = (0, 0)
        """(device blocks, host blocks) of the KV pool, to allocate it again at wake_up."""
        self.asleep: set[str] = set()
        """What sleep released and wake_up has not brought back: "weights", "kv_cache" (worker/sleep.py)."""

    def init_device(self) -> None:
        """Claim this rank's device (or, at tp > 1 on the CPU, its share of the cores), join the process group,
        choose the attention backend (its kernels are built or read from the cache here, before any request)
        and check the KV cache's dtype against it."""
        config, info = self.config, self.rank_info
        on_gpu = platform.is_cuda(config.device.device)
        self.device = _claim_device(on_gpu, info.local_rank)
        tp = config.parallel.tensor_parallel_size
        if config.parallel.world_size > 1:
            self._join_group(config.parallel, on_gpu)
        self.num_kv_heads = shard_heads(self.arch.num_heads, self.arch.num_kv_heads, tp, info.rank % tp).num_kv_heads
        backend = get_attention_backend(resolve_backend_name(config.device.attention_backend, config.device.device))
        self.kv_dtype = _kv_dtype(config.cache.cache_dtype, self.dtype, backend, on_gpu)
        if info.rank == 0:
            logger.info("%s; attention backend %s", platform.describe(config.model.dtype), backend.name)
        self.backend = backend

    def _join_group(self, parallel: ParallelConfig, on_gpu: bool) -> None:
        """A tensor-parallel rank or pipeline stage: pinned to its share of the cores (on the CPU, before torch
        starts its thread pools: they inherit the affinity), then in the process group (gloo; NCCL on GPUs), with its
        stage's layers at pipeline_parallel_size > 1."""
        info, pp = self.rank_info, parallel.pipeline_parallel_size
        if not on_gpu:  # pipeline stages share the cores (one runs at a time): 53.7 -> 96.1 tok/s at pp=2, 2 cores
            self.cores = rank_cores(*(info.core_share or (info.local_rank, info.local_world_size)))
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)
            torch.set_num_threads(len(self.cores))
        assert info.distributed_init_method is not None, "a tensor-parallel worker needs rank 0's address"
        stages = None if pp == 1 else layer_partition(self.arch.num_layers, pp, parallel.pp_layer_partition)
        init_distributed(info.rank, parallel.world_size, info.distributed_init_method, info.local_world_size,
                         backend="nccl" if on_gpu else "gloo", stages=stages)

    def load_model(self) -> None:
        """Load the weights (and a draft model's), process them, and make the model runner around them."""
        assert self.backend is not None, "init_device comes before load_model"
        self.model_runner = self._build_runner(self.backend)

    def _build_runner(self, backend: AttentionBackend) -> ModelRunner:
        config, arch, info = self.config, self.arch, self.rank_info
        meter = LoadMeter()
        meter.start()
        model = self._load_model(config.model.model, arch, "Loading weights")
        # LoRA layers first: packing leaves gate_up unfused where one is attached
        lora = None if config.lora is None else LoRAManager(model, config.lora, self.dtype, self.device)
        _process_weights(model, self.dtype, config.model.quantization, dense_copy_room(config, info.local_world_size))
        speculator, loaded = self._load_speculator(backend), weight_bytes(model)
        loaded += sum(weight_bytes(draft) for draft in (speculator.models() if speculator is not None else ()))
        self.load_report = meter.report(loaded)
        """How loading went: its time, the weights' bytes, the peak RSS (``memory_usage``, ``pagedllm bench``)."""
        if info.rank == 0:
            _log_load(self.load_report, model, config.model.quantization)
        return self._make_runner(model, backend, lora, speculator)

    def _make_runner(self, model: torch.nn.Module, backend: AttentionBackend, lora: LoRAManager | None,
                     speculator: Speculator | None) -> ModelRunner:
        """The runner of the loaded model: a pooling model's (with its pooler), a generating model's, or a pipeline
        stage's (worker/stage_runner.py)."""
        config, arch = self.config, self.arch
        if config.model.pooler is not None:
            pooler = Pooler(model, config.model.pooler, arch.problem_type)
            return runner_for(model, pooler)(model, backend, config.cache.block_size, config.model.seed,
                                             self._eos_token_ids, self.device, pooler, lora)
        grammars = functools.partial(compiler_for, config.model.model, arch.vocab_size, tuple(self._eos_token_ids),
                                     config.structured_outputs)
        runner = ModelRunner if get_pp_stage() is None else StageRunner  # a pipeline stage: its own step
        return runner(model, backend, config.cache.block_size, config.model.seed, self._eos_token_ids,
                      self.device, grammars, lora, speculator,
                      watermark=None if config.watermark is None else GumbelWatermark(config.watermark))

    def _load_speculator(self, backend: AttentionBackend) -> Speculator | None:
        """speculative_config's speculator; a draft model's weights loaded and kept as the target's are (a GGUF
        draft stays quantized, with what dense copies the target's left room for)."""
        spec = self.config.speculative
        self.draft_arch = None if spec is None or not spec.uses_draft_model else load_arch_config(spec.model)
        if self.draft_arch is None:
            return make_speculator(spec)
        draft = self._load_model(spec.model, self.draft_arch, "Loading draft weights")
        _process_weights(draft, self.dtype, self.config.model.quantization,
                         dense_copy_room(self.config, self.rank_info.local_world_size))
        return Speculator(spec, DraftModelProposer(draft, backend, self.config.cache.block_size, self.device))

    def _load_model(self, path: str, arch: ArchConfig, desc: str) -> torch.nn.Module:
        """The model at ``path`` on this worker's device with its kernels bound (weights not yet processed)."""
        config = self.config
        model = get_model_class(arch)(arch, self.dtype, config.model.max_model_len)
        if config.model.load_format == "dummy":
            model.to(self.device)
            _fill_dummy_weights(model, config.model.seed)
        else:
            quantized = config.model.quantization == "gguf" and path.endswith(".gguf")
            model.load_weights(tqdm(iter_weights(path, arch, quantized, self.dtype), desc=desc, unit=" tensors",
                                    leave=False, dynamic_ncols=True, disable=self.rank_info.rank != 0 or None))
            model.to(self.device)  # loaded on the host, then moved whole (a no-op on the CPU)
        bind_ops(model, self.device)  # each layer's implementation for this device, chosen once (layers/custom_op.py)
        return model

    def kv_block_bytes(self) -> int:
        """Bytes of one block across all layers (K and V; an int8 cache's scales included), a draft model's
        layers included (its K/V sit in the same blocks)."""
        stage = get_pp_stage()
        layers = None if stage is None else stage.end - stage.start  # a pipeline stage's: its own layers'
        return kv_block_bytes(self.arch, self.num_kv_heads, self.config.cache.block_size, self.kv_dtype,
                              self.draft_arch, layers)

    def determine_num_kv_blocks(self) -> int:
        """num_kv_blocks if given, else kv_cache_memory (or the default) / bytes per block.

        kv_cache_memory is per rank (as vLLM's per device); the default shares this machine's
        free memory between the ranks on it. The executor takes the smallest answer of all ranks.
        """
        cache = self.config.cache
        if self.config.model.encoder_only:  # bidirectional attention over whole inputs: nothing is cached
            return 0
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        budget = self._kv_budget()
        num_blocks = budget // self.kv_block_bytes()
        if num_blocks < 2:
            capped = cache.kv_cache_memory is None and cache.worker_memory_limit is not None  # what the weights left
            raise ValidationError.bad_value("worker_memory_limit" if capped else "kv_cache_memory",
                                            cache.worker_memory_limit if capped else budget,
                                            f"room for at least 2 KV blocks ({2 * self.kv_block_bytes()} bytes) "
                                            f"beside this rank's {self.load_report.weights_bytes} bytes of weights"
                                            if capped else f"at least 2 KV blocks ({2 * self.kv_block_bytes()} bytes)")
        return num_blocks

    def _kv_budget(self) -> int:
        """Bytes for this rank's KV pool: kv_cache_memory, else what a GPU leaves (a profiling step), else the
        CPU default (a share of this machine's free memory)."""
        cache, sched = self.config.cache, self.config.scheduler
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory
        if platform.is_cuda(self.device):
            return self._gpu_kv_budget()
        budget = default_kv_budget(self.kv_block_bytes(), cache.block_size, sched.max_num_seqs, sched.max_model_len,
                                   self.rank_info.local_world_size)
        if cache.worker_memory_limit is None:
            return budget
        # the limit holds the weights and the host swap blocks, then the KV pool
        left = cache.worker_memory_limit - self.load_report.weights_bytes - \
            self.determine_num_host_blocks() * self.kv_block_bytes()
        return max(0, min(budget, left))  # (under 2 blocks: refused by the caller, naming worker_memory_limit)

    def _gpu_kv_budget(self) -> int:
        """gpu_memory_utilization of the GPU, less the weights, the peak activations of a forward pass
        at max_num_batched_tokens (measured: a profiling step), and what is not torch's (CUDA context)."""
        sched = self.config.scheduler
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model_runner.profile_run(min(sched.max_num_batched_tokens, sched.max_model_len), self.kv_dtype)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        not_torch = max(0, total - free - torch.cuda.memory_reserved(self.device))
        torch.cuda.empty_cache()
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak - not_torch
        logger.info("GPU memory: %.2f GiB total, peak of a profiling step %.2f GiB, not torch's %.2f GiB: "
                    "%.2f GiB for the KV pool", total / 1024**3, peak / 1024**3, not_torch / 1024**3, budget / 1024**3)
        return budget

    def determine_num_host_blocks(self) -> int:
        """Blocks of host memory for swapped-out requests (swap_space GiB), when swapping is on."""
        if self.config.scheduler.preemption_mode != "swap":
            return 0
        return int(self.config.cache.swap_space * 1024**3) // self.kv_block_bytes()

    def initialize_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        """Allocate the KV pools: ``num_blocks`` on the device, ``num_host_blocks`` in host memory for swapping."""
        assert self.model_runner is not None, "load_model comes before initialize_cache"
        self._kv_blocks = (num_blocks, num_host_blocks)
        self.model_runner.initialize_kv_cache(num_blocks, self.kv_dtype, num_host_blocks)
        world = self.config.parallel.world_size
        where = "" if world == 1 else f"rank {self.rank_info.rank}/{world} (pid {os.getpid()}): "
        cores = "" if self.cores is None else f" on cores {_core_ranges(self.cores)}"
        logger.info("%sdevice %s, %d threads%s; KV cache %d blocks of %d tokens, %d KV heads, %s (%.2f GiB)", where,
                    self.device, torch.get_num_threads(), cores, num_blocks, self.config.cache.block_size,
                    self.num_kv_heads, str(self.kv_dtype).removeprefix("torch."),
                    num_blocks * self.kv_block_bytes() / 1024**3)

    def compile_or_warm_up_model(self) -> None:
        """On a GPU (unless enforce_eager), capture the decode steps in CUDA graphs, after initialize_cache: they
        hold the KV pools' addresses. The CPU has nothing to do here: its kernels were built by init_device and
        its weights packed by load_model."""
        dev = self.config.device
        if platform.is_cuda(self.device) and not dev.enforce_eager:
            model = self.model_runner.model
            if not getattr(model, "supports_cuda_graphs", True):
                if self.rank_info.rank == 0:
                    logger.warning("%s cannot be captured in CUDA graphs (its steps read data-dependent sizes back "
                                   "to the host): every step runs eagerly", type(model).__name__)
            elif self.model_runner.backend.supports_cuda_graphs:
                self.model_runner.capture_model(dev.cuda_graph_sizes, self.config.model.max_model_len)
            elif self.rank_info.rank == 0:
                logger.warning("the %s attention backend cannot be captured in CUDA graphs: every step runs eagerly",
                               self.model_runner.backend.name)

    def kv_cache_shapes(self) -> list[tuple[int, ...]]:
        """The shape of every layer's KV tensor on this rank (tests check the head split)."""
        return [tuple(t.shape) for t in self.model_runner.kv_caches]

    def memory_usage(self) -> dict[str, float]:
        """Bytes this rank holds: weights (packed copies included), its KV pools, and its process's RSS; and how
        its load went (seconds, the peak RSS while loading)."""
        runner = self.model_runner  # (None while a level-2 sleep dropped it)
        kv = 0 if runner is None else sum(t.nbytes for t in runner.kv_caches + runner.host_kv_caches)
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return {"weights_bytes": 0 if runner is None else weight_bytes(runner.model), "kv_cache_bytes": kv,
                "rss_bytes": rss,
                "load_seconds": self.load_report.seconds, "load_peak_rss_bytes": self.load_report.peak_rss_bytes}

    def request_token_ids(self) -> dict[str, list[int]]:
        """Every live request's tokens as this rank sampled them (tests check the ranks agree)."""
        return {req_id: list(state.token_ids) for req_id, state in self.model_runner.requests.items()}

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read and check a LoRA adapter against this rank's model (ValidationError if it does not fit)."""
        if self.model_runner.lora is None:
            raise ValidationError("LoRA adapters need enable_lora=True", param="lora_request",
                                  value=lora_request.lora_name)
        self.model_runner.lora.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if it was not added."""
        return self.model_runner.lora is not None and self.model_runner.lora.remove(lora_int_id)

    def sleep(self, level: int) -> None:
        """Release the KV pool (level 1) and the weights too (level 2) until wake_up (worker/sleep.py)."""
        sleep_worker(self, level)

    def wake_up(self, tags: list[str]) -> None:
        """Bring back what sleep released: "weights" (read again from the model files) and/or "kv_cache"."""
        wake_worker(self, tags)

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> Any:
        """``func(model)`` on this rank's model (LLM.apply_model, vLLM's: e.g. to inspect its layers)."""
        if self.model_runner is None:
            raise ValidationError("the model's weights are asleep (wake_up(['weights']) brings them back)",
                                  param="func")
        return func(self.model_runner.model)

    def user_rpc(self, method: str | bytes, args: tuple, kwargs: dict[str, Any]) -> tuple[bool, Any]:
        """A user's collective_rpc on this worker: (True, result) or (False, its error as data)."""
        return user_call(self, method, args, kwargs)

    def shutdown(self) -> None:
        """Leave the process group (an extension's destroy hook first)."""
        destroy_extension(self)
        destroy_distributed()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)


def _process_weights(model: torch.nn.Module, dtype: torch.dtype, quantization: str | None, room: int = 0) -> None:
    """Once the checkpoint is in: e.g. weights packed for the CPU GEMM, quantized to int8, or kept quantized with a
    dense copy beside them for steps of many rows (layers/prepack.py ``add_dense_copies``; ``room``: memory_fit.py
    ``dense_copy_room``)."""
    with int8_on_load(quantization == "int8"):
        for module in model.modules():
            if hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()
                heap.trim()  # a packed or quantized weight's transients: not kept resident (platform/heap.py)
    copied = add_dense_copies(model, dtype, quantization, room)
    if copied:
        logger.info("Dense %s copies beside the weights kept quantized: %.2f GiB (PAGEDLLM_DENSE_COPY=%s; steps of "
                    "more than %d rows run on them; 0 turns them off)", str(dtype).removeprefix("torch."),
                    copied / 2**30, platform.switches().dense_copy, DENSE_ROWS)
    model.eval()


def _claim_device(on_gpu: bool, local_rank: int) -> torch.device:
    """This rank's device: its GPU (made current) or the CPU."""
    if not on_gpu:
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


def _kv_dtype(cache_dtype: str, dtype: torch.dtype, backend: AttentionBackend, on_gpu: bool) -> torch.dtype:
    """The KV pool's dtype for kv_cache_dtype, refused where the attention backend cannot read it."""
    kv_dtype = kv_quant.kv_cache_torch_dtype(cache_dtype, dtype)
    if kv_dtype == torch.int8 and not backend.supports_int8_kv:
        where = "on a GPU no backend reads it yet" if on_gpu else f"the {backend.name!r} backend does not read it"
        raise ValidationError(f"kv_cache_dtype='int8' is read by the cpu and torch attention backends (CPU only): "
                              f"{where}", param="kv_cache_dtype", value=cache_dtype)
    return kv_dtype


def _log_load(report: Any, model: torch.nn.Module, quantization: str | None) -> None:
    """The start-up lines of a load: its time and memory, and what quantization kept of the weights."""
    logger.info("%s", report.line())
    if quantization:
        described = describe_quantized(model)
        (logger.warning if described.startswith("no weight") else logger.info)(
            "quantization=%s: %s", quantization, described)


@torch.no_grad()
def _fill_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """load_format="dummy": every weight uniform in [-1e-3, 1e-3] (vLLM's range: activations stay finite
    through any depth), drawn where the model lives (fast on a GPU); every norm module (RMSNorm, LayerNorm,
    whatever its parameters are called: BERT's "LayerNorm", GPT-2's "ln_1") the identity: weight 1 (0 for
    Gemma's, stored as an offset from 1), bias 0."""
    identity: dict[int, float] = {}
    for module in model.modules():
        if "norm" in type(module).__name__.lower():
            offset = isinstance(module, GemmaRMSNorm)
            for pname, param in module.named_parameters(recurse=False):
                identity[id(param)] = 0.0 if pname == "bias" or offset else 1.0
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for param in model.parameters():
        if id(param) in identity:
            param.fill_(identity[id(param)])
        else:
            param.uniform_(-1e-3, 1e-3, generator=generator)


def _core_ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)
