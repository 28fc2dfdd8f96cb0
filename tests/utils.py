"""Helpers the tests share (the conftest.py files hold only fixtures, which call these): a `pagedllm serve`
process on a free 127.0.0.1 port, the KV-pool checks after requests, tiny random models saved with transformers,
and the kernel levels this CPU runs."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    import openai

    from pagedllm import LLM
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.engine.async_llm import AsyncLLM

# ---------------------------------------------------------------------------------------------------------------
# A real server

def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`pagedllm serve MODEL --port P ...` in a subprocess; ready once /health answers 200."""

    def __init__(self, model: Path, *args: str, env: dict | None = None, log: Path | None = None,
                 preexec_fn: Callable[[], None] | None = None, command: tuple[str, ...] = ("serve",)) -> None:
        """``log``: a file for the server's output (a long run would fill a pipe nobody reads); ``preexec_fn``:
        run in the child before the server starts (e.g. to lower its resource limits); ``command``: the pagedllm
        command that serves (``("launch", "render")``: a render-only server)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", *command, str(model), "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--uvicorn-log-level", "warning", *args]
        out = subprocess.PIPE if log is None else open(log, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=preexec_fn)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = self.proc.stdout.read() if log is None else Path(log).read_text()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{text}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy within 120 s")

    def get_client(self) -> openai.OpenAI:
        """An OpenAI client of this server's /v1 (no retries: a test sees the first answer)."""
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def metric(self, name: str) -> float:
        """The value of one (single-series) Prometheus metric."""
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_idle(self, within: float = 10.0) -> float:
        """Seconds until nothing runs or waits and every KV block is back in the pool (AssertionError after
        ``within``): every request finished or aborted."""
        start = time.monotonic()
        while time.monotonic() - start < within:
            stats = httpx.get(f"{self.url}/stats", timeout=5).json()
            if stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_cache_usage"] == 0:
                return time.monotonic() - start
            time.sleep(0.02)
        raise AssertionError(f"the server did not go idle: {stats}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---------------------------------------------------------------------------------------------------------------
# The KV pool of an in-process engine

def thread_engine(model_dir: Path, **kwargs: Any) -> AsyncLLM:
    """An AsyncLLM on the model in ``model_dir`` (float32, 64 KV blocks unless ``kwargs`` say otherwise) with its
    engine core in a thread of this process: for apps served in-process (TestClient, httpx's ASGITransport)."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM

    args = EngineArgs(model=str(model_dir), **{"dtype": "float32", "num_kv_blocks": 64, **kwargs})
    return AsyncLLM.from_engine_args(args, multiprocess=False)


def _itself(worker: Any) -> Any:
    return worker


def worker_of(engine: Any) -> Any:
    """The only worker of an in-process engine (an LLM or its LLMEngine), through collective_rpc (vLLM's hook for
    running a function on the workers): the object itself, as nothing crosses a process."""
    if hasattr(engine, "llm_engine"):
        return engine.collective_rpc(_itself)[0]
    import pickle

    return engine.collective_rpc(pickle.dumps(_itself))[0]


def model_of(llm: LLM) -> Any:
    """The model (torch module) of an in-process LLM's only worker, through LLM.apply_model (vLLM's)."""
    return llm.apply_model(_itself)[0]


def kv_cache_manager(llm: LLM) -> KVCacheManager:
    """The KV cache manager of an LLM's scheduler."""
    return llm.llm_engine.engine_core.core.scheduler.kv_cache_manager


def assert_pool_clean(llm: LLM) -> None:
    """Nothing left of any request: none unfinished or still tracked by the output processor, every KV block
    and every host (swap) block back in the pool, and the pool's accounting intact."""
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.output_processor.requests
    kv = kv_cache_manager(llm)
    assert kv.check_integrity() and kv.num_free_blocks == kv.block_pool.num_usable_blocks
    assert len(kv.host_free) == kv.num_host_blocks


# ---------------------------------------------------------------------------------------------------------------
# Tiny random models

#: Tiny architectures the model tests cover; each is saved by transformers and loaded by us.
TINY_VARIANTS: dict[str, dict[str, Any]] = {
    "llama-gqa-untied": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "llama-mha-tied": dict(arch="llama", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope-scaling": dict(arch="llama", num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "llama-linear-rope": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2,
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-attention-bias": dict(arch="llama", num_attention_heads=4, num_key_value_heads=2, attention_bias=True),
    "qwen2-qkv-bias": dict(arch="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "mistral": dict(arch="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    "mistral-sliding-window": dict(arch="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=10),
    "qwen3-qk-norm": dict(arch="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          tie_word_embeddings=False),
    "gpt2": dict(arch="gpt2", num_attention_heads=4, n_inner=128),
    "opt-pre-ln": dict(arch="opt", num_attention_heads=4, ffn_dim=128, do_layer_norm_before=True),
    "opt-350m-style": dict(arch="opt", num_attention_heads=4, ffn_dim=128, do_layer_norm_before=False,
                           word_embed_proj_dim=32),
    "phi3-longrope": dict(arch="phi3", num_attention_heads=4, num_key_value_heads=2,
                          original_max_position_embeddings=64, sliding_window=None, pad_token_id=0,
                          rope_scaling={"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                                        "long_factor": [2.0 + i / 4 for i in range(8)]}),
    "gemma2": dict(arch="gemma2", num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                   num_hidden_layers=3),
    "gemma3": dict(arch="gemma3", num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                   query_pre_attn_scalar=24, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "mixtral": dict(arch="mixtral", num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=48),
    "qwen2-moe": dict(arch="qwen2_moe", num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=3),
}


def with_context(model: Path, folder: Path, max_position_embeddings: int) -> Path:
    """``folder``: ``model``'s files linked in, its config.json with a longer (or shorter) context."""
    for f in model.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((model / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": max_position_embeddings}))
    return folder


def save_tiny_model(path: Path, variant: str, vocab_size: int = 512, tokenizer: Any = None, seed: int = 0,
                    **overrides: Any) -> Path:
    """Save a tiny random model of ``variant`` (weights scaled up so logits are not all ~0); ``overrides``
    change config fields of the variant."""
    import torch
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        OPTConfig,
        OPTForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    spec = {**TINY_VARIANTS[variant], **overrides}
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "mistral": (MistralConfig, MistralForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM), "gpt2": (GPT2Config, GPT2LMHeadModel),
                             "opt": (OPTConfig, OPTForCausalLM), "mixtral": (MixtralConfig, MixtralForCausalLM),
                             "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
                             "phi3": (Phi3Config, Phi3ForCausalLM), "gemma2": (Gemma2Config, Gemma2ForCausalLM),
                             "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM)}[spec.pop("arch")]
    fields = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    config = config_cls(**{**fields, **spec})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # biases and norms start at 0 / 1: randomise them so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


# ---------------------------------------------------------------------------------------------------------------
# Kernel levels

def kernel_levels() -> list[str]:
    """Every level with compiled kernels this process runs: the CPU's own (or PAGEDLLM_ISA's, which
    makes the whole suite behave as on such a CPU) and each one below it, forced in turn."""
    from pagedllm.platform.cpu import LEVELS, isa_level

    top = isa_level()
    return [level for level in LEVELS[1:LEVELS.index(top) + 1] if level != "amx"]  # amx runs avx512_bf16's


def end_levels() -> list[str]:
    """The lowest and the highest compiled level this process runs: for whole-model tests, whose every kernel is
    tested at each level on its own (the levels between run the same code paths at another width)."""
    levels = kernel_levels()
    return sorted({levels[0], levels[-1]}, key=levels.index) if levels else []


def amx_kernels() -> Any:
    """The "amx" level's CpuKernels (bf16 on AMX tiles), or a skip where this CPU (or PAGEDLLM_ISA) has no AMX."""
    import pytest

    from pagedllm.layers import cpu_ops
    from pagedllm.platform import isa_level

    if isa_level() != "amx":
        pytest.skip("AMX tiles: this CPU (or PAGEDLLM_ISA) has no amx level")
    kernels = cpu_ops.kernels("amx")
    assert kernels is not None and kernels.amx
    return kernels


def at_kernel_level(level: str) -> Any:
    """Context: ``level`` made the active one (skips the test where its kernels did not build); returns the entered
    context (exit it after the test) and the active CpuKernels."""
    from pagedllm.layers import cpu_ops

    context = cpu_ops.use_level(level)
    context.__enter__()
    active = cpu_ops.active()
    if level != "portable" and (active is None or active.level != level):
        context.__exit__(None, None, None)
        pytest.skip(f"the {level} kernels did not build here")
    return context, active
