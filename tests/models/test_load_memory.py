"""Loading leaves no second copy of the weights (issue 44): the peak RSS while a worker loads a ~107 MB bf16
safetensors folder, or the same weights as a Q8_0 GGUF file (kept quantized, and dequantized), grows by no more
than the weights it ends with, plus 10%, plus a fixed allowance; a model of twice the layers raises that peak by
its extra weights, not twice them (the machine's fixed costs cancel); and an engine whose weights and KV cache
cannot fit the memory available is refused before it allocates anything, with the figures."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.errors import ValidationError
from pagedllm.worker import memory_fit

ALLOWANCE = 64 * 2**20
"""Bytes a load may add beyond its weights + 10%, whatever the model's size: 21-38 MiB measured on a Zen 4, 50-55
MiB on CI's machine: the code pages of torch's kernels run for the first time (~13 MiB, mapped files), the largest
weight while its packed copy is made (11 MiB), a tensor decoded from a GGUF file with its slices' temporaries
(gguf_loader._DEQUANTIZE_BYTES of float32 values and the decoder's intermediates of that size), the allocator's
arenas. Fixed costs differ by machine; the test of twice the layers is the one they cannot blur."""

SCALING_ALLOWANCE = 16 * 2**20
"""Noise allowed on the difference of two loads' peaks (one run in three here moved a peak by ~14 MiB)."""

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=4096, tie_word_embeddings=False, max_position_embeddings=2048)
"""~54M parameters (107 MB in bf16), Llama-3's proportions: GQA, untied, the embedding table and the LM head each
8% of the weights (the 10% covers a tensor's transient copy, which real models' tables stay under: 6% for
SmolLM2-1.7B's, 7% for Llama-3-8B's)."""


def random_weights(layers: int) -> dict[str, torch.Tensor]:
    """HF-named random bf16 tensors of a Llama of SHAPE with ``layers`` layers (norms 1)."""
    h, inter, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    kv = SHAPE["num_key_value_heads"] * h // SHAPE["num_attention_heads"]
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": rand(v, h), "lm_head.weight": rand(v, h),
           "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("q_proj", (h, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, h))):
            out[f"{p}self_attn.{name}.weight"] = rand(*shape)
        for name, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            out[f"{p}mlp.{name}.weight"] = rand(*shape)
        for name in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{name}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return out


LAYERS = (SHAPE["num_hidden_layers"], 2 * SHAPE["num_hidden_layers"])
"""The two sizes loaded: SHAPE's layers, and twice them (~197 MB in bf16)."""


def write_folder(folder: Path, layers: int) -> Path:
    """The random Llama of SHAPE with ``layers`` layers as an HF folder (no tokenizer: a worker loads it alone)."""
    from safetensors.torch import save_file

    save_file(random_weights(layers), folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", **SHAPE, "num_hidden_layers": layers}))
    return folder


def write_q8_gguf(path: Path, layers: int) -> Path:
    """The same weights as a GGUF file, matrices in Q8_0 (the gguf package's quantizer), norms in float32."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    writer = GGUFWriter(str(path), "llama")
    for key, value in (("context_length", SHAPE["max_position_embeddings"]), ("embedding_length", SHAPE["hidden_size"]),
                       ("block_count", layers), ("feed_forward_length", SHAPE["intermediate_size"]),
                       ("attention.head_count", SHAPE["num_attention_heads"]),
                       ("attention.head_count_kv", SHAPE["num_key_value_heads"]), ("vocab_size", SHAPE["vocab_size"])):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    names = {"model.embed_tokens": "token_embd", "lm_head": "output", "model.norm": "output_norm",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in random_weights(layers).items():
        base = name.removesuffix(".weight")
        if base.startswith("model.layers."):
            _, _, layer, rest = base.split(".", 3)
            base = f"blk.{layer}.{names[rest]}"
        else:
            base = names[base]
        values = tensor.float().numpy()
        if values.ndim == 2:
            writer.add_tensor(f"{base}.weight", quantize(values, GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(f"{base}.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def bf16_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The random Llama as HF folders, by number of layers (LAYERS)."""
    return {layers: write_folder(tmp_path_factory.mktemp(f"load-memory-{layers}"), layers) for layers in LAYERS}


@pytest.fixture(scope="module")
def q8_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The random Llama as Q8_0 GGUF files, by number of layers (LAYERS)."""
    return {layers: write_q8_gguf(tmp_path_factory.mktemp("load-memory-gguf") / f"q8_0-{layers}.gguf", layers)
            for layers in LAYERS}


def load_in_subprocess(model: Path, **options: Any) -> dict[str, int]:
    """A worker of a fresh process loads ``model`` (bf16, 8 KV blocks): its LoadReport, read there."""
    script = (
        "import json, sys\n"
        "from pagedllm.engine.arg_utils import EngineArgs\n"
        "from pagedllm.worker.extension import make_worker\n"
        "config, arch = EngineArgs(**json.loads(sys.argv[1])).create_engine_config()\n"
        "print(json.dumps(vars(make_worker(config, arch, (2,)).load_report)))\n")
    args = {"model": str(model), "dtype": "bfloat16", "num_kv_blocks": 8, **options}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(args)], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def estimate(model: Path, **options: Any) -> memory_fit.WeightBytes:
    """The fits-in-memory check's weight bytes for ``model`` loaded as ``load_in_subprocess`` loads it."""
    config, arch = EngineArgs(model=str(model), dtype="bfloat16", num_kv_blocks=8, **options).create_engine_config()
    return memory_fit.estimate_weight_bytes(str(model), arch, config)


def assert_no_second_copy(models: dict[int, Path], **options: Any) -> None:
    """Each size's peak stays within its weights + 10% + ALLOWANCE, each size holds the bytes the fits-in-memory
    check counts, and twice the layers raise the peak by their weights + 10% + SCALING_ALLOWANCE at most (a
    second copy of each weight would raise it by twice them)."""
    growth, weights = {}, {}
    for layers, model in models.items():
        report = load_in_subprocess(model, **options)
        growth[layers], weights[layers] = report["peak_rss_bytes"] - report["rss_before_bytes"], report["weights_bytes"]
        assert weights[layers] == estimate(model, **options).final  # what the fits-in-memory check counts
        assert growth[layers] <= 1.10 * weights[layers] + ALLOWANCE, \
            f"loading {weights[layers] / 2**20:.1f} MiB of weights raised the RSS by {growth[layers] / 2**20:.1f} MiB"
    small, large = LAYERS
    extra_growth, extra_weights = growth[large] - growth[small], weights[large] - weights[small]
    assert extra_growth <= 1.10 * extra_weights + SCALING_ALLOWANCE, \
        f"{extra_weights / 2**20:.1f} MiB more weights raised the peak RSS by {extra_growth / 2**20:.1f} MiB more"


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads Linux's per-process peak RSS")
def test_a_safetensors_folder_loads_without_a_second_copy(bf16_folders: dict[int, Path]) -> None:
    """The file's pages are let go tensor by tensor, packing frees each plain weight as it goes, the untied LM
    head keeps only its packed copy: the peak is the weights, not twice them (before: safetensors' own reader
    kept every page of the file it had read mapped until the file's end)."""
    small = bf16_folders[LAYERS[0]]
    assert 100 * 2**20 < estimate(small).final < 110 * 2**20  # the untied LM head: its packed copy only
    assert_no_second_copy(bf16_folders)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads Linux's per-process peak RSS")
@pytest.mark.parametrize("quantization", ["auto", None])
def test_a_gguf_file_loads_without_a_second_copy(q8_ggufs: dict[int, Path], quantization: str | None) -> None:
    """The same weights in Q8_0, kept in that format where the kernels run ("auto") or dequantized to bf16 (None):
    the file's pages are let go as each tensor is read, a matrix is decoded a slice of rows at a time (before:
    every page of the file stayed mapped, and a matrix was decoded whole to float32 and copied once more)."""
    assert_no_second_copy(q8_ggufs, quantization=quantization)


def test_the_estimate_is_what_loading_takes(tiny_llm_dir: Path, tiny_model: Callable[[str], Path]) -> None:
    """The fits-in-memory check's weight bytes, from shapes alone, are those a loaded model holds: untied (the
    LM head's plain weight dropped once packed), tied (the table kept, the LM head's packed copy beside it), and
    quantized to int8 rows at load (the tied table's rows shared by the LM head)."""
    tied = tiny_model("llama-mha-tied")
    for model, options in ((tiny_llm_dir, {}), (tied, {}), (tied, {"quantization": "int8"})):
        llm = LLM(str(model), dtype="bfloat16", num_kv_blocks=8, **options)
        try:
            held = llm.llm_engine.rank_memory_usage()[0]["weights_bytes"]
            config, arch = EngineArgs(model=str(model), dtype="bfloat16", num_kv_blocks=8,
                                                           **options).create_engine_config()
            assert memory_fit.estimate_weight_bytes(str(model), arch, config).final == held, (model, options)
        finally:
            llm.shutdown()


def test_weights_and_kv_that_cannot_fit_are_refused_with_the_figures(tiny_llm_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with 64 MiB available, a 1 GiB KV cache is refused before loading, naming what the weights
    and the KV cache need and what is available; 8 MiB of KV cache on the same machine is not refused."""
    monkeypatch.setattr(memory_fit, "available_memory_bytes", lambda: 64 * 2**20)
    with pytest.raises(ValidationError) as refused:
        LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="1GiB")
    message = str(refused.value)
    assert refused.value.param == "kv_cache_memory"
    config, arch = EngineArgs(model=str(tiny_llm_dir), dtype="float32", kv_cache_memory="1GiB").create_engine_config()
    weights = memory_fit.estimate_weight_bytes(str(tiny_llm_dir), arch, config).final
    kv, _ = memory_fit.requested_kv_bytes(config, arch, None)
    assert f"{weights / 2**30:.2f} GiB for the weights" in message
    assert f"{kv / 2**30:.2f} GiB for the KV cache (kv_cache_memory=1.00 GiB)" in message
    assert "0.06 GiB available" in message and f"{(weights + kv) / 2**30:.2f} GiB needed" in message
    LLM(str(tiny_llm_dir), dtype="float32", kv_cache_memory="8MiB").shutdown()


def test_the_kv_figure_counts_every_rank_and_swap_space(tiny_llm_dir: Path) -> None:
    """Ranks on one machine each hold kv_cache_memory (their own heads' blocks of it) and, with swapping,
    swap_space of host blocks; num_kv_blocks is blocks of every rank; by default the least a worker accepts."""
    def kv(**options: Any) -> int:
        config, arch = EngineArgs(model=str(tiny_llm_dir), dtype="float32", **options).create_engine_config()
        return memory_fit.requested_kv_bytes(config, arch, None)[0]

    one = kv(num_kv_blocks=10)
    assert one % 10 == 0 and kv(num_kv_blocks=10, tensor_parallel_size=2) == one  # 4 KV heads split 2 + 2
    block = one // 10
    assert kv() == 2 * block
    assert kv(kv_cache_memory=100 * block + 5) == 100 * block
    assert kv(kv_cache_memory=100 * block, tensor_parallel_size=2) == 2 * 100 * block
    assert kv(num_kv_blocks=10, preemption_mode="swap", swap_space=0.001) == one + 2**30 // 1000 // block * block


def test_int8_rows_a_slice_at_a_time_are_the_whole_weights_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """quantization="int8" quantizes a weight a slice of rows at a time (its float32 temporaries were ~3x the
    weight's float32 size): the same bytes as all rows at once, a part slice at the end."""
    from pagedllm.layers import quant

    weight = torch.randn(37, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    whole = quant.int8_rows(weight)
    monkeypatch.setattr(quant, "_INT8_SLICE_BYTES", 4 * 96 * 5)  # 5 rows a slice
    sliced = quant.int8_rows(weight)
    assert torch.equal(sliced.data, whole.data) and sliced.shape == whole.shape == (37, 96)


def test_ranks_on_one_node_are_checked_against_its_memory(tiny_llm_dir: Path) -> None:
    """The Ray executor's check once its actors are placed, before any loads: the ranks on one node together
    against that node's available memory (one stage per node fits where both stages on one do not)."""
    config, arch = EngineArgs(model=str(tiny_llm_dir), dtype="float32", pipeline_parallel_size=2,
                              distributed_executor_backend="ray", kv_cache_memory="8MiB").create_engine_config()
    ranks = memory_fit.plan_ranks(config, arch)
    each = max(r.need for r in ranks)
    memory_fit.check_nodes(config, arch, [("a", each), ("b", each)])
    with pytest.raises(ValidationError) as refused:
        memory_fit.check_nodes(config, arch, [("a", each + 1), ("a", each + 1)])
    assert refused.value.param == "kv_cache_memory" and "(2 ranks)" in str(refused.value)
    assert "MemAvailable of node a" in str(refused.value)
