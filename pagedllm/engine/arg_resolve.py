"""EngineArgs' options resolved into an EngineConfig (``engine_config``, which ``EngineArgs.create_engine_config``
calls): read against the model's files (its architecture, a GGUF file's formats, a sentence-transformers folder's
pooling) and the machine (device, dtype, kernels), checked against each other (speculation and LoRA against the
parallel layout, features a pooling model does not take), refused with an error that names the option. The one
place an option is resolved; the configs' own checks (pagedllm/config/) validate each value alone.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from pagedllm import envs, platform
from pagedllm.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    WatermarkConfig,
    json_object,
    parse_cuda_graph_sizes,
    parse_memory,
)
from pagedllm.config.options import EngineOptions
from pagedllm.distributed.parallel_state import layer_partition, shard_heads
from pagedllm.errors import ValidationError
from pagedllm.layers import cpu_ops
from pagedllm.models.config import ArchConfig
from pagedllm.models.loader import load_arch_config, matryoshka_dimensions, quantized_formats, resolve_model_path
from pagedllm.models.loader.sentence_transformers import read_sentence_transformers_config, read_task_prompts
from pagedllm.models.registry import get_model_class, supported_models
from pagedllm.worker.extension import worker_class

logger = logging.getLogger(__name__)


def engine_config(args: EngineOptions) -> tuple[EngineConfig, ArchConfig]:
    """Every option resolved against the model's files and this machine, or refused (ValidationError naming
    it); with the model's architecture, read once here (the workers are given it)."""
    path = resolve_model_path(args.model)
    overrides = None if args.hf_overrides is None else json_object(args.hf_overrides, "hf_overrides")
    arch = load_arch_config(path, overrides)  # the one read of the target's config
    if overrides:
        logger.info("config.json overridden by hf_overrides: %s", json.dumps(overrides, sort_keys=True))
    device = platform.resolve_device(args.device)
    pooling = pooling_setup(args, path, arch, overrides)
    parallel = parallel_config(args, arch, pooling.runner)
    lora = lora_config(args, parallel)
    speculative = speculative_config(args.speculative_config, parallel, arch)
    watermark = watermark_config(args, speculative)
    check_features(args, pooling, arch, speculative, lora, watermark)
    model = model_config(args, path, arch, device, pooling)
    config = EngineConfig(
        model=model, cache=cache_config(args, arch, pooling), scheduler=scheduler_config(args, model, lora),
        parallel=parallel, lora=lora, speculative=speculative, watermark=watermark, device=device_config(args, device),
        structured_outputs=structured_outputs_config(args.grammar_cache_memory, args.max_grammar_memory))
    return config, arch


def device_config(args: EngineOptions, device: str) -> DeviceConfig:
    """The resolved device, its attention backend and CUDA graph sizes."""
    return DeviceConfig(device=device, attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                        cuda_graph_sizes=parse_cuda_graph_sizes(args.cuda_graph_sizes, args.max_num_seqs))


def model_config(args: EngineOptions, path: str, arch: ArchConfig, device: str, pooling: Pooling) -> ModelConfig:
    """The model's config: dtype and quantization resolved for the device, max_model_len against the model's
    context (and its pooling's trained length), max_logprobs -1 as the vocabulary."""
    max_logprobs = args.max_logprobs
    if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < -1:
        raise ValidationError.bad_value("max_logprobs", max_logprobs,
                                        "an integer >= 0, or -1 for the vocabulary size")
    limit = arch.max_position_embeddings - arch_position_offset(arch)
    default_len = limit if pooling.max_seq_length is None else min(limit, pooling.max_seq_length)
    max_model_len = default_len if args.max_model_len is None else args.max_model_len
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not 1 <= max_model_len <= limit:
        raise ValidationError.bad_value("max_model_len", max_model_len,
                                        f"an integer in [1, the model's context length {limit}]")
    if isinstance(args.seed, bool) or not isinstance(args.seed, int):
        raise ValidationError.bad_value("seed", args.seed, "an integer")
    dtype = args.dtype
    if dtype == "auto":  # a GPU computes in bf16 natively; a CPU: what its kernels run fastest
        dtype = "bfloat16" if platform.is_cuda(device) else platform.default_dtype()
    return ModelConfig(model=path, dtype=dtype, max_model_len=max_model_len, seed=args.seed,
                       load_format=args.load_format, quantization=quantization_of(args, path, arch, device),
                       runner=pooling.runner, convert=pooling.convert, pooler=pooling.pooler,
                       encoder_only=arch.is_encoder_only,
                       labels=labels_of(arch) if pooling.convert == "classify" else (),
                       max_logprobs=arch.vocab_size if max_logprobs == -1 else max_logprobs,
                       enable_prompt_embeds=bool(args.enable_prompt_embeds),
                       enable_sleep_mode=check_flag("enable_sleep_mode", args.enable_sleep_mode))


def quantization_of(args: EngineOptions, path: str, arch: ArchConfig, device: str) -> str | None:
    """quantization "auto": a GGUF file's quantized matrices stay so where the kernels run them."""
    if args.quantization == "auto":
        keep = (args.load_format == "auto" and cpu_ops.kernels_for(device) is not None  # the layers' own answer
                and quantized_formats(path, arch))
        return "gguf" if keep else None
    if args.quantization is not None and platform.is_cuda(device):
        raise ValidationError.bad_value("quantization", args.quantization,
                                        "None on a GPU (the quantized kernels are the CPU's)")
    return args.quantization


def parallel_layout(args: EngineOptions) -> ParallelConfig:
    """The parallel options alone, checked (what the data-parallel client reads before any replica has resolved
    the rest against the model)."""
    return ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size, distributed_executor_backend=args.distributed_executor_backend,
        pipeline_parallel_size=args.pipeline_parallel_size, pp_layer_partition=args.pp_layer_partition,
        batches_in_flight=None if args.pipeline_parallel_size == 1 else envs.PP_BATCHES_IN_FLIGHT.read(),
        data_parallel_size=args.data_parallel_size, data_parallel_backend=args.data_parallel_backend,
        data_parallel_routing=args.data_parallel_routing, data_parallel_restart=args.data_parallel_restart,
        worker_extension_cls=args.worker_extension_cls)


def parallel_config(args: EngineOptions, arch: ArchConfig, runner: str = "generate") -> ParallelConfig:
    """The parallel layout, refused before any worker starts if the model cannot be split so or the worker
    extension cannot be mixed in."""
    parallel = parallel_layout(args)
    if parallel.worker_extension_cls:
        worker_class(parallel.worker_extension_cls)
    for rank in range(parallel.tensor_parallel_size):
        shard_heads(arch.num_heads, arch.num_kv_heads, parallel.tensor_parallel_size, rank)
    if parallel.pipeline_parallel_size > 1:
        check_pipeline(args, parallel, arch, runner)
    return parallel


def check_pipeline(args: EngineOptions, parallel: ParallelConfig, arch: ArchConfig, runner: str) -> None:
    """pipeline_parallel_size > 1: the model splits so (its stages' layers, ``layer_partition``), and nothing is
    asked for that the stages do not run yet (each refused naming it; ``runner``: the resolved one)."""
    pp = parallel.pipeline_parallel_size
    _check_stage_architecture(arch, pp)
    layer_partition(arch.num_layers, pp, parallel.pp_layer_partition)
    refused = [("device", platform.is_cuda(platform.resolve_device(args.device)), "'cpu'"),
               ("speculative_config", args.speculative_config is not None, "None"),
               ("enable_prompt_embeds", bool(args.enable_prompt_embeds), "false"),
               ("runner", runner == "pooling", "'generate' (a pooling model: runner or convert)")]
    for name, asked, allowed in refused:
        if asked:
            raise ValidationError(f"{name} must be {allowed} with pipeline_parallel_size {pp} (not run in pipeline "
                                  "stages yet)", param=name, value=getattr(args, name))


def _check_stage_architecture(arch: ArchConfig, pp: int) -> None:
    """The architecture runs in pipeline stages (models/registry.py), else a ValidationError naming those that do."""
    models = supported_models()
    if not getattr(models.get(arch.architecture), "pipeline_parallel", False):
        able = ", ".join(name for name, entry in models.items() if entry.pipeline_parallel)
        raise ValidationError(f"{arch.architecture} does not run in pipeline stages; the architectures that do: "
                              f"{able}", param="pipeline_parallel_size", value=pp)


def watermark_config(args: EngineOptions, speculative: SpeculativeConfig | None) -> WatermarkConfig | None:
    """watermark_config parsed; refused beside speculation."""
    watermark = WatermarkConfig.from_user(args.watermark_config)
    if watermark is not None and speculative is not None:  # (vLLM's dual_key_gumbel: not here)
        raise ValidationError("watermark_config cannot be combined with speculative_config (drafts would be "
                              "accepted unwatermarked)", param="watermark_config", value=args.watermark_config)
    return watermark


def check_features(args: EngineOptions, pooling: Pooling, arch: ArchConfig, speculative: SpeculativeConfig | None,
                    lora: LoRAConfig | None, watermark: WatermarkConfig | None) -> None:
    """Generating models' features refused for a pooling model; prompt embeddings checked against the model."""
    if pooling.runner == "pooling":
        for param, value in (("speculative_config", speculative), ("enable_lora", lora),
                             ("watermark_config", watermark)):
            if value is not None:
                raise ValidationError(f"{param} is for generating models: a pooling model ({pooling.convert}) "
                                      "does not take it", param=param, value=getattr(args, param))
    if args.enable_prompt_embeds:
        check_prompt_embeds(arch, pooling.runner, speculative)


def cache_config(args: EngineOptions, arch: ArchConfig, pooling: Pooling) -> CacheConfig:
    """The KV pool's config (no prefix caching for a pooling model)."""
    return CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                       kv_cache_memory=None if args.kv_cache_memory is None else parse_memory(args.kv_cache_memory),
                       # pooled inputs want every token's hidden state: a cached prefix would skip some
                       enable_prefix_caching=args.enable_prefix_caching and pooling.runner != "pooling",
                       swap_space=args.swap_space, gpu_memory_utilization=args.gpu_memory_utilization,
                       worker_memory_limit=None if args.worker_memory_limit is None else
                       parse_memory(args.worker_memory_limit, "worker_memory_limit"),
                       sliding_window=arch.sliding_window if arch.every_layer_slides else None,
                       cache_dtype=args.kv_cache_dtype)


def scheduler_config(args: EngineOptions, model: ModelConfig, lora: LoRAConfig | None) -> SchedulerConfig:
    """A step's limits."""
    # a pooled input is never chunked (every token's hidden state is needed at once): a step holds the longest
    batched = args.max_num_batched_tokens
    if model.runner == "pooling":
        batched = max(batched, model.max_model_len)
    return SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=batched,
                           max_model_len=model.max_model_len, preemption_mode=args.preemption_mode,
                           max_loras=lora.max_loras if lora else None,
                           max_num_batched_attention=args.max_num_batched_attention,
                           # 0 is off too: a command line cannot say None
                           step_time_target=None if is_zero(args.step_time_target) else args.step_time_target)


def check_prompt_embeds(arch: ArchConfig, runner: str, speculative: SpeculativeConfig | None) -> None:
    """enable_prompt_embeds' refusals: a model whose forward cannot take embeddings, a pooling runner, speculation
    (its proposers read the prompt's token ids, which such a prompt does not have)."""
    if runner == "pooling":
        raise ValidationError("enable_prompt_embeds is for generating models: a pooling model does not take it",
                              param="enable_prompt_embeds", value=True)
    if speculative is not None:
        raise ValidationError("enable_prompt_embeds cannot be combined with speculative_config (proposers read the "
                              "prompt's token ids)", param="enable_prompt_embeds", value=True)
    if not getattr(get_model_class(arch), "supports_prompt_embeds", False):
        raise ValidationError(f"enable_prompt_embeds: {arch.architecture} does not take prompt embeddings (the "
                              "Llama-family models, GPT-2 and OPT do: pagedllm models)", param="enable_prompt_embeds",
                              value=True)


def check_flag(name: str, value: object) -> bool:
    """A boolean option checked: ``value`` itself, or ValidationError naming ``name``."""
    if not isinstance(value, bool):
        raise ValidationError.bad_value(name, value, "true or false")
    return value


def is_zero(value: object) -> bool:
    """A number equal to 0 (False is not one): how a command line says None."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value == 0


def structured_outputs_config(grammar_cache_memory: int | str, max_grammar_memory: int | str | None
                              ) -> StructuredOutputsConfig:
    """The grammar cache and the per-request grammar budget, in bytes."""
    cache = parse_memory(grammar_cache_memory, "grammar_cache_memory")
    most = (cache // 4 if max_grammar_memory is None  # a quarter: several such grammars fit the cache
            else parse_memory(max_grammar_memory, "max_grammar_memory"))
    return StructuredOutputsConfig(grammar_cache_bytes=cache, max_grammar_bytes=most)


@dataclasses.dataclass(frozen=True)
class Pooling:
    """What the model is run for: runner, convert, the pooler and the longest input its pooling was trained on."""

    runner: str
    convert: str
    pooler: PoolerConfig | None
    max_seq_length: int | None


def arch_position_offset(arch: ArchConfig) -> int:
    """Position slots a model uses before a sequence's first token (RoBERTa: pad_token_id + 1)."""
    return getattr(arch, "position_offset", 0)


def pooling_setup(options: EngineOptions, path: str, arch: ArchConfig, overrides: dict[str, Any] | None) -> Pooling:
    """runner and convert resolved as vLLM does ("auto": pooling for sentence-transformers folders, encoder-only
    models and *ForSequenceClassification checkpoints), and the pooling from the folder's sentence-transformers
    config (else CLS for encoders, LAST for decoders; normalized) with pooler_config over it."""
    st = read_sentence_transformers_config(path)
    encoder, classifier = arch.is_encoder_only, arch.architecture.endswith("ForSequenceClassification")
    runner = options.runner
    if runner not in ("auto", "generate", "pooling"):
        raise ValidationError.bad_value("runner", runner, "'auto', 'generate' or 'pooling'")
    if runner == "auto":
        runner = "pooling" if st is not None or encoder or classifier else "generate"
    convert = options.convert
    if convert not in ("auto", "none", "embed", "classify"):
        raise ValidationError.bad_value("convert", convert, "'auto', 'none', 'embed' or 'classify'")
    if runner == "generate":
        if encoder or classifier:
            raise ValidationError(f"{arch.architecture} does not generate text: serve it with runner='pooling' "
                                  "(--runner pooling) for embeddings, classes or scores", param="runner",
                                  value=options.runner)
        if convert not in ("auto", "none"):
            raise ValidationError.bad_value("convert", convert, "'none' (or 'auto') with runner 'generate'")
        if options.pooler_config is not None:
            raise ValidationError.bad_value("pooler_config", options.pooler_config, "None with runner 'generate'")
        return Pooling("generate", "none", None, None)
    if convert == "auto":
        convert = "classify" if classifier else "embed"
    if convert == "none":
        raise ValidationError.bad_value("convert", convert, "'embed', 'classify' or 'auto' with runner 'pooling'")
    if convert == "classify" and not classifier:
        raise ValidationError(f"convert='classify' needs a classification head (*ForSequenceClassification); "
                              f"{arch.architecture} has none: use convert='embed'", param="convert", value=convert)
    if options.tensor_parallel_size != 1 and encoder:
        raise ValidationError.bad_value("tensor_parallel_size", options.tensor_parallel_size,
                                        f"1 for {arch.architecture} (encoders are not split across ranks)")
    base = PoolerConfig(pooling_type=st.pooling_type if st else ("CLS" if encoder else "LAST"),
                        normalize=st.normalize if st else True,
                        matryoshka_dimensions=matryoshka_dimensions(path, overrides),
                        task_prompts=read_task_prompts(path, overrides))
    pooler = PoolerConfig.from_user(base, options.pooler_config)
    if convert != "embed" and (pooler.enable_chunked_processing or pooler.max_embed_len is not None):
        name = "enable_chunked_processing" if pooler.enable_chunked_processing else "max_embed_len"
        raise ValidationError(f"pooler_config.{name} is for embedding models; this one classifies "
                              f"(convert={convert!r})", param=f"pooler_config.{name}", value=getattr(pooler, name))
    return Pooling("pooling", convert, pooler, st.max_seq_length if st else None)


def labels_of(arch: ArchConfig) -> tuple[str, ...]:
    """A classifier's label names in output order."""
    names = tuple(arch.id2label)
    return names if len(names) == arch.num_labels else tuple(f"LABEL_{i}" for i in range(arch.num_labels))


def speculative_config(value: SpeculativeConfig | dict[str, Any] | str | None, parallel: ParallelConfig,
                       arch: ArchConfig) -> SpeculativeConfig | None:
    """speculative_config parsed and checked against the rest of the engine; None when off."""
    spec = SpeculativeConfig.from_user(value)
    if spec is None or not spec.uses_draft_model:
        return spec
    if parallel.tensor_parallel_size > 1:
        raise ValidationError("a draft model runs with tensor_parallel_size 1 only (the draft is not split "
                              "across ranks yet); ngram and suffix speculation run at any size",
                              param="speculative_config.model", value=spec.model)
    if not isinstance(spec.model, str) or not spec.model:
        raise ValidationError.bad_value("speculative_config.model", spec.model, "a model folder or .gguf file")
    path = resolve_model_path(spec.model)
    draft = load_arch_config(path)
    if draft.vocab_size != arch.vocab_size:
        raise ValidationError(f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the model's "
                              f"({arch.vocab_size}): a draft must share the target's tokenizer",
                              param="speculative_config.model", value=spec.model)
    return dataclasses.replace(spec, model=path)


def lora_config(args: EngineOptions, parallel: ParallelConfig) -> LoRAConfig | None:
    """The LoRA config with enable_lora, else None (its limits are checked only when it is on)."""
    if not check_flag("enable_lora", args.enable_lora):
        return None
    if parallel.distributed_executor_backend != "uni":
        raise ValidationError("enable_lora runs in the in-process executor only (tensor_parallel_size 1, "
                              "distributed_executor_backend 'uni'): LoRA layers are not split across ranks yet",
                              param="enable_lora", value=True)
    return LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras)
