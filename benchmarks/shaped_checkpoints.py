"""Random-weight checkpoints at the shapes people serve (issue 44), written once and cached.

Each is an HF folder (config.json, bf16 safetensors shards, the default model's tokenizer) written tensor by
tensor: at most one tensor is in memory at a time, so a 16 GB folder is written on a machine with less free
memory than that. The folder appears whole or not at all (written as ``<name>.tmp``, renamed at the end), so
several processes may ask for the same one.

    .venv/bin/python benchmarks/shaped_checkpoints.py smollm2-1.7b     # -> /tmp/big/smollm2-1.7b-bf16
    .venv/bin/python benchmarks/shaped_checkpoints.py llama-8b         # -> /tmp/big/llama-8b-bf16 (16 GB)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Iterator

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ROOT = "/tmp/big"

SHAPES: dict[str, dict] = {
    # SmolLM2-1.7B: MHA (32 KV heads), tied embeddings
    "smollm2-1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                         intermediate_size=8192, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192, rope_theta=130000.0, rms_norm_eps=1e-5),
    # Llama-3.1-8B: GQA (8 KV heads), untied, Llama 3's vocabulary size (the default model's tokenizer covers the
    # first 49,152 ids; the rest are never produced by it)
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                     max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5),
}

SHARD_BYTES = 2 * 1024**3
"""Tensors per safetensors file up to about this size (as transformers shards)."""


def tensor_shapes(cfg: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor of a LlamaForCausalLM with config ``cfg``, in checkpoint order."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    yield "model.embed_tokens.weight", (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (h, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, h)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", (v, h)


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """bf16 values: norms near 1, matrices with std 0.02 (activations stay finite through any depth)."""
    if len(shape) == 1:
        return (1 + 0.05 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
    out = torch.empty(shape, dtype=torch.bfloat16)
    rows = max(1, (64 << 20) // (4 * shape[1]))  # float32 draws in ~64 MiB slices, never the whole tensor
    for start in range(0, shape[0], rows):
        stop = min(shape[0], start + rows)
        out[start:stop] = torch.randn((stop - start, shape[1]), generator=generator) * 0.02
    return out


def write_checkpoint(folder: str, cfg: dict, seed: int = 0, tokenizer_source: str | None = None) -> str:
    """Write a random bf16 LlamaForCausalLM of config ``cfg`` to ``folder`` (atomically: ``folder``.tmp, renamed)
    with the tokenizer of ``tokenizer_source`` (a GGUF file or HF folder; default: the default model's)."""
    from pagedllm.models.loader import default_model_path, load_tokenizer

    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    tmp = f"{folder}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    generator = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    index: dict[str, str] = {}
    files: list[str] = []

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, os.path.join(tmp, name), metadata={"format": "pt"})
        os.chmod(os.path.join(tmp, name), 0o644)  # safetensors writes 0600: other users' benchmarks read it too
        files.append(name)
        index.update({k: name for k in shard})
        shard.clear()

    size = 0
    for name, shape in tensor_shapes(cfg):
        tensor = random_tensor(name, shape, generator)
        if shard and size + tensor.nbytes > SHARD_BYTES:
            flush()
            size = 0
        shard[name] = tensor
        size += tensor.nbytes
    flush()
    # the shard names must say how many there are (transformers' convention): rename now that the count is known
    final = {}
    for i, name in enumerate(files):
        new = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.rename(os.path.join(tmp, name), os.path.join(tmp, new))
        final[name] = new
    total = sum(os.path.getsize(os.path.join(tmp, f)) for f in final.values())
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in index.items()}}, f)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "bos_token_id": 1,
              "eos_token_id": 2, **cfg}
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    load_tokenizer(tokenizer_source or default_model_path()).save_pretrained(tmp)
    try:
        os.rename(tmp, folder)
    except OSError:  # another process finished first: keep its folder
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def checkpoint(shape: str, root: str = ROOT) -> str:
    """The cached folder of ``shape`` (a key of SHAPES), written first if missing."""
    return write_checkpoint(os.path.join(root, f"{shape}-bf16"), SHAPES[shape])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--root", default=ROOT)
    args = parser.parse_args()
    print(checkpoint(args.shape, args.root))


if __name__ == "__main__":
    main()
