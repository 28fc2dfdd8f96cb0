"""The synchronous engine: add requests, step, read outputs."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from typing import Any

from pagedllm import platform
from pagedllm.config import (CacheConfig, DeviceConfig, EngineArgs, EngineConfig, LoRAConfig, ModelConfig,
                             ParallelConfig, SchedulerConfig, StructuredOutputsConfig, parse_cuda_graph_sizes,
                             parse_memory)
from pagedllm.core.kv_map import kv_map
from pagedllm.core.scheduler import Scheduler, SchedulerStats
from pagedllm.lora_request import LoRARequest
from pagedllm.engine.output_processor import IterationStats, OutputProcessor
from pagedllm.engine.beam_search import BeamSearchManager
from pagedllm.engine.processor import MAX_LOGPROBS, Processor, PromptType
from pagedllm.errors import ValidationError
from pagedllm.distributed.parallel_state import shard_heads
from pagedllm.executor.factory import get_executor_class
from pagedllm.models.config import ArchConfig
from pagedllm.models.registry import supported_models  # noqa: F401  (re-exported for the CLI)
from pagedllm.layers import cpu_ops
from pagedllm.models.loader import (load_arch_config, load_eos_token_ids, load_tokenizer, quantized_formats,
                                    resolve_model_path)
from pagedllm.outputs import EngineCoreOutput, RequestOutput
from pagedllm.request import RequestStatus
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.worker.structured_output import compiler_for

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineStats(SchedulerStats):
    """Scheduler counters plus the facts of this engine's KV pool."""

    num_kv_blocks: int = 0
    block_size: int = 0


def create_engine_config(args: EngineArgs) -> tuple[EngineConfig, ArchConfig]:
    """Resolve the model path, dtype and max_model_len; build every subsystem's config."""
    path = resolve_model_path(args.model)
    arch = load_arch_config(path)
    device = resolve_device(args.device)
    quantization = args.quantization
    if quantization == "auto":  # a GGUF file's quantized matrices stay so where the kernels run them
        quantization = "gguf" if (device == "cpu" and args.load_format == "auto" and cpu_ops.active() is not None
                                  and quantized_formats(path, arch)) else None
    elif quantization is not None and device == "cuda":
        raise ValidationError.bad_value("quantization", quantization,
                                        "None on a GPU (the quantized kernels are the CPU's)")
    dtype = args.dtype
    if dtype == "auto":  # a GPU computes in bf16 natively; a CPU: what its kernels run fastest
        dtype = "bfloat16" if device == "cuda" else platform.default_dtype()
    limit = arch.max_position_embeddings
    max_model_len = limit if args.max_model_len is None else args.max_model_len
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
        raise ValidationError.bad_value("max_model_len", max_model_len,
                                        f"an integer in [1, the model's context length {limit}]")
    if isinstance(args.seed, bool) or not isinstance(args.seed, int):
        raise ValidationError.bad_value("seed", args.seed, "an integer")
    parallel = ParallelConfig(args.tensor_parallel_size, args.distributed_executor_backend)
    for rank in range(parallel.tensor_parallel_size):  # refuse a split the model cannot take before any worker starts
        shard_heads(arch.num_heads, arch.num_kv_heads, parallel.tensor_parallel_size, rank)
    kv_memory = None if args.kv_cache_memory is None else parse_memory(args.kv_cache_memory)
    lora = _lora_config(args, parallel)
    config = EngineConfig(
        model=ModelConfig(path, dtype, max_model_len, args.seed, args.load_format, quantization),
        cache=CacheConfig(args.block_size, kv_memory, args.num_kv_blocks, args.enable_prefix_caching,
                          args.swap_space, args.gpu_memory_utilization,
                          arch.sliding_window if arch.every_layer_slides else None, args.kv_cache_dtype),
        scheduler=SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, max_model_len,
                                  args.preemption_mode, lora.max_loras if lora else None),
        parallel=parallel,
        device=DeviceConfig(device, args.attention_backend, args.enforce_eager,
                            parse_cuda_graph_sizes(args.cuda_graph_sizes, args.max_num_seqs)),
        lora=lora,
        structured_outputs=StructuredOutputsConfig(parse_memory(args.grammar_cache_memory, "grammar_cache_memory")),
    )
    return config, arch


def _lora_config(args: EngineArgs, parallel: ParallelConfig) -> LoRAConfig | None:
    """The LoRA config with enable_lora, else None."""
    if not isinstance(args.enable_lora, bool):
        raise ValidationError.bad_value("enable_lora", args.enable_lora, "true or false")
    if not args.enable_lora:
        return None
    if parallel.distributed_executor_backend != "uni":
        raise ValidationError("enable_lora runs in the in-process executor only (tensor_parallel_size 1, "
                              "distributed_executor_backend 'uni'): LoRA layers are not split across ranks yet",
                              param="enable_lora", value=True)
    return LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when torch sees a GPU, else "cpu"; "cuda" without one is refused."""
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValidationError("device 'cuda' was asked for but torch sees no CUDA device (this torch build: "
                              f"{torch.__version__})", param="device", value=device)
    return device


def get_tokenizer(model: str | None = None) -> Any:
    """The tokenizer of ``model`` (default: the default model), as the engine would load it."""
    return load_tokenizer(resolve_model_path(model))


class LLMEngine:
    """Owns the processor, scheduler, executor and output processor; one ``step()`` is one batch."""

    def __init__(self, config: EngineConfig, arch: ArchConfig, tokenizer: Any, log_stats: bool = False) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.last_step_features: list[float] = []
        """Scheduler.step_features of the last step (the step-time log of `pagedllm serve --step-log`)."""
        eos = load_eos_token_ids(config.model.model, arch, tokenizer)
        # the worker's own compiler when it runs in this process (one grammar cache per process)
        grammars = functools.partial(compiler_for, config.model.model, arch.vocab_size, tuple(eos),
                                     config.structured_outputs.grammar_cache_bytes)
        self.processor = Processor(tokenizer, config.model.max_model_len, arch.vocab_size, eos, grammars)
        self.executor = get_executor_class(config)(config, arch, eos)
        try:
            self.num_kv_blocks = self.executor.determine_num_kv_blocks()
            self.num_host_blocks = self.executor.determine_num_host_blocks()
            self.executor.initialize_cache(self.num_kv_blocks, self.num_host_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_kv_blocks, self.num_host_blocks)
        self.output_processor = OutputProcessor(tokenizer, log_stats)
        self.beam_search = BeamSearchManager(self.scheduler, eos, tokenizer)
        self._seq_counter = itertools.count()
        self.loras: dict[int, LoRARequest] = {}
        """LoRA adapters added (checked by the workers), by lora_int_id."""

    @classmethod
    def from_engine_args(cls, args: EngineArgs, log_stats: bool = False) -> "LLMEngine":
        """Build an engine; ``log_stats`` gathers per-step timing (take it with take_iteration_stats)."""
        config, arch = create_engine_config(args)
        return cls(config, arch, load_tokenizer(config.model.model), log_stats)

    # ----------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request (with a LoRA adapter: ``lora_request``); on ValidationError nothing is
        queued."""
        self._check_new_id(request_id)
        params = params if params is not None else SamplingParams()
        text, prompt_ids = self.processor.tokenize_prompt(prompt)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        arrival_time = arrival_time or time.monotonic()
        seq_ids = self.new_seq_ids(request_id, params.n)
        try:
            self.add_tokenized(seq_ids, prompt_ids, params, arrival_time, cache_salt, lora_request)
            self.output_processor.add_request(request_id, text, prompt_ids, params, seq_ids, arrival_time)
        except BaseException:
            self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)  # none of it left queued
            raise

    def new_seq_ids(self, request_id: str, n: int) -> list[str]:
        """The scheduler's ids of a request's n samples (engine-made: users' ids can never collide with them)."""
        return [f"{next(self._seq_counter)}:{request_id}" for _ in range(n)]

    def add_tokenized(self, seq_ids: list[str], prompt_ids: list[int], params: SamplingParams, arrival_time: float,
                      cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> None:
        """The engine core's half of add_request: check the parameters against the model and queue the samples
        (an engine core process gets the prompt already tokenized; the caller tracks the outputs)."""
        if not isinstance(params, SamplingParams):
            raise ValidationError.bad_value("sampling_params", params, "a SamplingParams")
        if lora_request is not None:
            self.add_lora(lora_request)
        requests = self.processor.make_requests(seq_ids, prompt_ids, params, arrival_time, cache_salt, lora_request)
        # the n samples of a prompt fork from the first once its prompt is computed (shared blocks)
        self.scheduler.add_request(requests[0], requests[1:])

    def add_beam_request(self, request_id: str, prompt: PromptType, params: BeamSearchParams,
                         arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        """Queue a beam search; its one RequestOutput holds the beam_width best sequences, best first."""
        text, prompt_ids = self.processor.tokenize_prompt(prompt)
        self.add_beam_tokenized(request_id, text, prompt_ids, params, arrival_time or time.monotonic(), lora_request)

    def add_beam_tokenized(self, request_id: str, text: str | None, prompt_ids: list[int], params: BeamSearchParams,
                           arrival_time: float, lora_request: LoRARequest | None = None) -> None:
        """The engine core's half of add_beam_request (the prompt already tokenized)."""
        if not isinstance(params, BeamSearchParams):
            raise ValidationError.bad_value("params", params, "a BeamSearchParams")
        self._check_new_id(request_id)
        if 2 * params.beam_width > MAX_LOGPROBS:
            raise ValidationError.bad_value("beam_width", params.beam_width, f"<= {MAX_LOGPROBS // 2}")
        seq_params = self.beam_search.sampling_params(params)
        if lora_request is not None:
            self.add_lora(lora_request)
        first = self.processor.make_requests(self.new_seq_ids(request_id, 1), prompt_ids, seq_params, arrival_time,
                                             lora_request=lora_request)[0]
        self.scheduler.add_request(first)
        self.beam_search.add(request_id, text, first, params)

    # ----------------------------------------------------------------------- LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter on every worker (ValidationError if it does not fit the model); True if
        it was new. Requests naming an adapter not added yet add it first."""
        if self.config.lora is None:
            raise ValidationError("LoRA adapters need enable_lora=True", param="lora_request",
                                  value=getattr(lora_request, "lora_name", lora_request))
        if not isinstance(lora_request, LoRARequest):
            raise ValidationError.bad_value("lora_request", lora_request, "a LoRARequest")
        known = self.loras.get(lora_request.lora_int_id)
        if known == lora_request:
            return False
        self.executor.collective_rpc("add_lora", (lora_request,))  # refuses an id taken by another adapter
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter no live request uses; False if it was not added."""
        users = [r.request_id for r in self.scheduler.requests.values()
                 if r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id]
        if users:
            raise ValidationError(f"LoRA adapter {lora_int_id} is in use by {len(users)} request(s)",
                                  param="lora_int_id", value=lora_int_id)
        if self.loras.pop(lora_int_id, None) is None:
            return False
        self.executor.collective_rpc("remove_lora", (lora_int_id,))
        return True

    def list_loras(self) -> set[int]:
        """The ids of the adapters added."""
        return set(self.loras)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.output_processor.requests or request_id in self.beam_search.groups:
            raise ValidationError(f"request id {request_id!r} is already in use", param="request_id", value=request_id)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their blocks."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.abort_seqs(request_id, self.output_processor.seq_ids(request_id))
            self.output_processor.abort(request_id)

    def abort_seqs(self, request_id: str, seq_ids: list[str]) -> None:
        """The engine core's half of abort_request: free the samples ``seq_ids`` (or the beams of ``request_id``)."""
        self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_ABORTED)
        self.beam_search.abort(request_id)

    def stop_seqs(self, seq_ids: list[str]) -> None:
        """Finish samples a stop string ended (found by whoever detokenizes); unknown ids are ignored."""
        self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        """Requests still to run: step() has work."""
        return self.scheduler.has_unfinished_requests()

    # ----------------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and return the outputs of the requests it advanced.

        The batch also tells the workers which requests finished since the last step (an idle
        engine runs no step of its own for that: they learn it with the next real one).
        """
        core_outputs, outputs = self.step_core()
        news, stopped = self.output_processor.process(core_outputs)
        self.stop_seqs(stopped)
        return news + outputs

    def step_core(self) -> tuple[list[EngineCoreOutput], list[RequestOutput]]:
        """The engine core's half of step(): one batch scheduled and run; (the samples' new tokens for the
        caller to detokenize, the finished beam searches' RequestOutputs)."""
        scheduler_output = self.scheduler.schedule()
        self.last_step_features = self.scheduler.step_features(scheduler_output)
        runner_output = self.executor.execute_model(scheduler_output)
        core_outputs = self.scheduler.update_from_output(runner_output)
        beams = [o for o in core_outputs if self.beam_search.owns(o.request_id)]
        return [o for o in core_outputs if not self.beam_search.owns(o.request_id)], self.beam_search.process(beams)

    def rank_memory_usage(self) -> list[dict[str, int]]:
        """Per tensor-parallel rank, in rank order: bytes of weights, of KV pools, and its process's RSS."""
        return self.executor.collective_rpc("memory_usage")

    def shutdown(self) -> None:
        """Stop the executor's workers (processes, Ray actors); idempotent."""
        self.executor.shutdown()

    def take_iteration_stats(self) -> IterationStats:
        """Timing facts since the last call: times to first token, inter-token latencies, finished requests."""
        return self.output_processor.take_iteration_stats()

    def kv_map(self, cells: bool = True) -> dict[str, Any]:
        """The KV pool now (between steps): each block's holder and the slots' accounting (core/kv_map.py)."""
        return kv_map(self.scheduler.kv_cache_manager, self.scheduler.requests, cells)

    def get_stats(self) -> EngineStats:
        """Counters (steps, preemptions, chunked prefills, max running) and KV usage now and at peak."""
        return EngineStats(**dataclasses.asdict(self.scheduler.stats), num_kv_blocks=self.num_kv_blocks,
                           block_size=self.config.cache.block_size)
