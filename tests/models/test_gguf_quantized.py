"""quantization="gguf": GGUF files whose matrices are Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K (written by
the gguf package in the test from a tiny model converted by llama.cpp's converter, one format or llama.cpp's Q4_K_M
mix) run with their weights kept in those formats, at the lowest and highest kernel level this CPU runs (each level's
kernels on their own: tests/layers/test_quant_gemm.py): the layers hold the quantized rows, the logits stay
within the activations' int8 error of the same file dequantized, the compiled decoder stack equals the
layers one by one bit for bit, and the portable level falls back to the dequantized weights. Also
quantization="int8" (an HF checkpoint quantized at load), the default model's agreement and perplexity."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.errors import ValidationError
from pagedllm.layers.quant import QuantWeight, int8_rows
from tests.gguf_quant import q4_k_m_type, quantize_matrix, requantize, rewrite
from tests.models.smollm_prompts import PROSE, common_prefixes, greedy_and_perplexity
from tests.models.test_cpu_stack import assert_stack_equals_the_layers
from tests.models.test_gguf_families import CONVERTER, NOT_FETCHED, convert, train_sentencepiece
from tests.models.test_tiny_logits import paged_logits
from tests.utils import end_levels, model_of, save_tiny_model

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
pytestmark = pytest.mark.skipif(not (CONVERTER / "convert_hf_to_gguf.py").exists(), reason=NOT_FETCHED)


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (widths multiples of 256, as the K-quants' blocks) as a float32 GGUF file."""
    folder = tmp_path_factory.mktemp("quant-llama")
    vocab = train_sentencepiece(folder / "tokenizer.model")
    save_tiny_model(folder, "llama-gqa-untied", vocab_size=vocab, hidden_size=256, intermediate_size=512,
                    bos_token_id=2, eos_token_id=1)
    return convert(folder, folder.parent / "f32.gguf")


@pytest.fixture(scope="module")
def quantized(f32_gguf: Path) -> dict[str, Path]:
    return {name: requantize(f32_gguf, f32_gguf.parent / f"{name}.gguf", GGMLQuantizationType[name])
            for name in TYPES}


@pytest.fixture(scope="module")
def q4_k_m(f32_gguf: Path) -> Path:
    """The tiny Llama with its MLP 384 wide (new random weights: a width off the K-quants' 256) in llama.cpp's
    Q4_K_M mix (q4_k_m_type), layer 0's q, k and v in Q5_K (where a fused attn_qkv would have it)."""
    q5_k = ("blk.0.attn_q.", "blk.0.attn_k.", "blk.0.attn_v.")
    return rewrite(f32_gguf, f32_gguf.parent / "q4km.gguf", lambda name, cols: q4_k_m_type(name, cols, 2, q5_k),
                   intermediate=384)


_Q4_K_M_LAYOUT = {  # each layer's segments (row order), as q4_k_m's file has them
    "model.embed_tokens": ["Q4_K"], "lm_head": ["Q6_K"],
    "model.layers.0.self_attn.qkv_proj": ["Q5_K"], "model.layers.1.self_attn.qkv_proj": ["Q4_K", "Q6_K"],  # q|k, v
    "model.layers.0.mlp.down_proj": ["Q5_0"], "model.layers.1.mlp.down_proj": ["Q8_0"],  # Q4_K, Q6_K off 256
    **{f"model.layers.{i}.{name}": ["Q4_K"] for i in (0, 1) for name in ("self_attn.o_proj", "mlp.gate_up_proj")}}


@pytest.mark.parametrize("kernels", end_levels(), indirect=True)
def test_a_q4_k_m_mix_keeps_each_matrix_in_its_format(kernels, q4_k_m: Path) -> None:
    """llama.cpp's Q4_K_M mix (Q4_K, Q5_K, Q6_K; Q5_0 and Q8_0 for the widths off 256): every matrix kept in its
    file's format (a q|k|v of two formats as two segments), every kept row as the kernels read it equal to the
    gguf package's dequantization of the file, and greedy tokens equal to the dequantized model's up to a near tie
    of the dequantized model's (random weights give flat logits; measured: 4 of 6 equal, the others part at top-2
    gaps of 0.053 and 0.086 nats, the int8 activations moving log-probabilities by up to ~0.1)."""
    from pagedllm.models.loader.gguf_loader import iter_weights, load_arch_config

    prompts = [{"prompt_token_ids": torch.randint(4, 319, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
               for n in (3, 9, 17, 5, 11, 23)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = []
    for quantization in ("gguf", None):
        llm = LLM(str(q4_k_m), quantization=quantization, dtype="float32", num_kv_blocks=32)
        outs.append([out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)])
        model = model_of(llm)
        llm.shutdown()
        if quantization == "gguf":
            kept = model
    equal = 0
    for got, want in zip(*outs):
        part = next((i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), None)
        if part is None:
            equal += 1
            continue
        top = {token: lp.logprob for token, lp in want.logprobs[part].items()}  # the dequantized model's top 2
        chosen = got.token_ids[part]
        assert chosen in top and max(top.values()) - top[chosen] < 0.15, (part, chosen, top)
    assert equal >= len(prompts) // 2
    reference = dict(iter_weights(str(q4_k_m), load_arch_config(str(q4_k_m))))  # HF name -> float32, by gguf
    layout = {}
    for name, module in kept.named_modules():
        quant = getattr(module, "quant", None)
        if not isinstance(quant, QuantWeight):
            continue
        layout[name] = [piece.type_name for _, piece in sorted(quant.pieces.items())]
        fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
        parts = fused.get(name.rsplit(".", 1)[-1], ())
        want = torch.cat([reference[f"{name.rsplit('.', 1)[0]}.{p}.weight"] for p in parts]) if parts \
            else reference[f"{name}.weight"]  # (rows, cols) in the layer's row order
        for offset, piece in quant.pieces.items():
            rows = quant.kernels.qrows(piece, torch.arange(piece.rows), torch.float32)  # (piece rows, cols)
            assert torch.allclose(rows, want[offset:offset + piece.rows], rtol=1e-6, atol=1e-7), (name, offset)
    assert layout == _Q4_K_M_LAYOUT


@pytest.mark.parametrize("name,bound", [("Q8_0", 0.01), ("Q6_K", 0.03), ("Q5_K", 0.05), ("Q4_K", 0.1), ("Q4_1", 0.1),
                                        ("Q5_1", 0.05)])
def test_quantizers_round_trip(name: str, bound: float) -> None:
    """The test's own Q4_K / Q5_K / Q6_K writers against the gguf package's decoders (and its Q8_0 / Q4_1 / Q5_1)."""
    from gguf.quants import dequantize

    x = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    y = dequantize(quantize_matrix(x, GGMLQuantizationType[name]), GGMLQuantizationType[name])
    assert np.sqrt(((y - x) ** 2).mean() / (x ** 2).mean()) < bound


@pytest.mark.parametrize("kernels", end_levels(), indirect=True)  # each level's kernels: tests/layers/test_quant_gemm
@pytest.mark.parametrize("name", TYPES)
def test_quantized_logits_stay_near_the_dequantized_ones(kernels, quantized: dict[str, Path], name: str) -> None:
    """Prefill in chunks, then decodes: every position's logits within 5% of the logits' scale of the same
    file dequantized (float32 both), nearly every argmax the same, and every linear layer holding its rows
    in the file's format."""
    seq = torch.randint(4, 319, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    schedule = [[8], [6]] + [[1]] * 7
    want = paged_logits(quantized[name], [seq], schedule, quantization=None)[0]
    got = paged_logits(quantized[name], [seq], schedule, quantization="gguf")[0]
    rel = (got - want).abs().max() / want.abs().max()
    assert rel < 0.05, f"{name}: relative logits error {rel:.3f}"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    llm = LLM(str(quantized[name]), quantization="gguf", dtype="float32", num_kv_blocks=16)
    model = model_of(llm)
    llm.shutdown()
    layer = model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                   model.lm_head):
        assert isinstance(linear.quant, QuantWeight) and linear.weight.numel() == 0
        assert {piece.type_name for piece in linear.quant.pieces.values()} == {name}
    assert model.model.embed_tokens.quant is not None


@pytest.fixture(scope="module")
def q4_k_m_256(f32_gguf: Path) -> Path:
    """The tiny Llama in llama.cpp's Q4_K_M mix, every width a multiple of 256: Q4_K but for layer 1's v and down
    and the output, in Q6_K (layer 1's q|k|v: two segments)."""
    return rewrite(f32_gguf, f32_gguf.parent / "q4km256.gguf", lambda name, cols: q4_k_m_type(name, cols, 2))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q4_K_M"])
def test_quantized_stack_equals_the_layers(kernels, quantized: dict[str, Path], q4_k_m_256: Path, name: str) -> None:
    """The compiled decoder stack with packed quantized weights (Q4_K_M: Q4_K and Q6_K, a q|k|v of both formats):
    the same floats as the layers one by one."""
    path = q4_k_m_256 if name == "Q4_K_M" else quantized[name]
    llm = LLM(str(path), quantization="gguf", dtype="bfloat16", num_kv_blocks=64, enable_prefix_caching=False)
    if name == "Q4_K_M":
        qkv = model_of(llm).model.layers[1].self_attn.qkv_proj
        assert [(piece.type_name, piece.packed) for _, piece in sorted(qkv.quant.pieces.items())] == \
            [("Q4_K", True), ("Q6_K", True)]
    assert_stack_equals_the_layers(llm)


@pytest.fixture
def dense_copies(monkeypatch: pytest.MonkeyPatch) -> Any:
    """PAGEDLLM_DENSE_COPY=1 for the test (the switches are read once: cleared before and after)."""
    from pagedllm import platform

    monkeypatch.setenv("PAGEDLLM_DENSE_COPY", "1")
    platform.switches.cache_clear()
    yield
    monkeypatch.undo()
    platform.switches.cache_clear()


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K_M"])
def test_dense_copies_run_the_steps_of_many_rows(kernels, dense_copies, quantized: dict[str, Path],
                                                 q4_k_m_256: Path, name: str) -> None:
    """PAGEDLLM_DENSE_COPY=1: every weight kept quantized gets a bf16 copy of what its rows decode to; steps of more
    than DENSE_ROWS rows run on the copies (the stack only the others), steps of fewer on the quantized kernels; the
    logits of both stay within 5% of the file dequantized; the weights' bytes count the copies, as the
    fits-in-memory estimate does."""
    from pagedllm.layers import prepack, quant
    from pagedllm.models.cpu_stack import CpuDecoderStack
    from pagedllm.worker import memory_fit

    path = q4_k_m_256 if name == "Q4_K_M" else quantized[name]
    seq = torch.randint(4, 319, (66,), generator=torch.Generator().manual_seed(5)).tolist()
    schedule = [[60]] + [[1]] * 6
    want = paged_logits(path, [seq], schedule, quantization=None)[0]
    dense_rows, kernel_rows = [], []
    plain, onednn, quantized_linear = prepack._plain_linear, prepack._onednn, prepack.quant_linear
    with pytest.MonkeyPatch.context() as spy:  # the copy: oneDNN's layout where oneDNN runs bf16, else plain
        spy.setattr(prepack, "_plain_linear", lambda w, x, b: dense_rows.append(x.shape[0]) or plain(w, x, b))
        spy.setattr(prepack, "_onednn", lambda w, x, b: dense_rows.append(x.shape[0]) or onednn(w, x, b))
        spy.setattr(prepack, "quant_linear", lambda x, q, b=None: kernel_rows.append(x.shape[0]) or
                    quantized_linear(x, q, b))
        got = paged_logits(path, [seq], schedule, dtype="bfloat16", quantization="gguf")[0]
    assert set(dense_rows) == {60} and set(kernel_rows) == {1}, (dense_rows, kernel_rows)
    assert (got - want).abs().max() / want.abs().max() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9

    llm = LLM(str(path), quantization="gguf", dtype="bfloat16", num_kv_blocks=64, enable_prefix_caching=False)
    model = model_of(llm)
    weights = quant.kept_weights(model)
    assert len(weights) == 2 * 4 + 2 and all(q.dense is not None for q in weights)  # 2 layers, embedding, head
    for q in weights:  # the copy's rows in the weight's order: the kernels' products match the copy's
        x = torch.randn(quant.DENSE_ROWS + 1, q.cols, generator=torch.Generator().manual_seed(q.rows)).bfloat16()
        on_copy = prepack.matmul_for(None, q)(x).float()
        assert (quant.quant_linear(x, q).float() - on_copy).abs().max() < 0.05 * on_copy.abs().max()
    held = llm.llm_engine.rank_memory_usage()[0]["weights_bytes"]
    config, arch = EngineArgs(model=str(path), quantization="gguf", dtype="bfloat16",
                                                   num_kv_blocks=64).create_engine_config()
    assert memory_fit.estimate_weight_bytes(str(path), arch, config).final == held
    assert held > sum(q.dense.numel() * 2 for q in weights)
    if model.model._stack is False:  # built at the first step, unless warm-up ran one
        model.model._stack = CpuDecoderStack.build(model.model)
    stack = model.model._stack
    assert stack is not None and stack.max_rows == quant.DENSE_ROWS
    served: list[int] = []
    run = stack.run
    stack.run = lambda hidden, positions: served.append(hidden.shape[0]) or run(hidden, positions)
    assert_stack_equals_the_layers(llm)
    assert served and max(served) <= quant.DENSE_ROWS, served  # the decodes in the stack, the 60-row step not


def test_dense_copies_by_default_only_for_bf16_gguf_models_on_amx_with_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """PAGEDLLM_DENSE_COPY=auto (the default): copies at the amx level for a bf16 GGUF model whose copies take at
    most 1 GiB or half the room the weights and KV pool leave, nowhere else; "0" never, "1" always. The room: what
    the OS can still give less every rank's KV pool (kv_cache_memory, else the default's 4 GiB cap), per rank."""
    from types import SimpleNamespace

    from pagedllm import platform
    from pagedllm.layers.quant import DENSE_AUTO_BYTES, wants_dense
    from pagedllm.worker import memory_fit

    bf16, gguf, big = torch.bfloat16, "gguf", DENSE_AUTO_BYTES + 1
    try:
        monkeypatch.delenv("PAGEDLLM_DENSE_COPY", raising=False)
        platform.switches.cache_clear()
        assert wants_dense(True, bf16, gguf, DENSE_AUTO_BYTES)
        assert not wants_dense(True, bf16, gguf, big)
        assert not wants_dense(True, bf16, gguf, big, room=2 * big - 2)  # more than half the room
        assert wants_dense(True, bf16, gguf, big, room=2 * big)  # a 1.7B Q4_K_M's 3.4 GB copy on a 24 GB machine
        assert not wants_dense(False, bf16, gguf, big, room=1 << 50)
        monkeypatch.setattr(memory_fit, "available_memory_bytes", lambda: 20 << 30)
        config = SimpleNamespace(cache=SimpleNamespace(kv_cache_memory=2 << 30))  # (only its KV pool is read)
        assert memory_fit.dense_copy_room(config, 1) == 18 << 30
        assert memory_fit.dense_copy_room(config, 2) == 8 << 30  # two ranks: two pools, the rest shared
        default = SimpleNamespace(cache=SimpleNamespace(kv_cache_memory=None))
        assert memory_fit.dense_copy_room(default, 1) == 16 << 30  # the default pool's cap
        monkeypatch.setattr(memory_fit, "available_memory_bytes", lambda: 1 << 30)
        assert memory_fit.dense_copy_room(config, 1) == 0
        assert not wants_dense(False, bf16, gguf, 1 << 20)  # no AMX tiles
        assert not wants_dense(True, torch.float32, gguf, 1 << 20)
        assert not wants_dense(True, bf16, "int8", 1 << 20)
        for mode, want in (("0", False), ("1", True)):
            monkeypatch.setenv("PAGEDLLM_DENSE_COPY", mode)
            platform.switches.cache_clear()
            assert wants_dense(True, bf16, gguf, 1 << 20) is want
            assert wants_dense(False, torch.float32, "int8", 1 << 40) is want
    finally:
        monkeypatch.undo()
        platform.switches.cache_clear()


def test_portable_level_dequantizes(quantized: dict[str, Path]) -> None:
    """Where no compiled kernels run, quantization="gguf" runs the dequantized weights (the same results as
    quantization=None)."""
    from pagedllm.layers import cpu_ops

    prompt = [{"prompt_token_ids": list(range(4, 30))}]
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True)
    outs = []
    with cpu_ops.use_level("portable"):
        for quantization in ("gguf", None):
            llm = LLM(str(quantized["Q4_K"]), quantization=quantization, dtype="float32", num_kv_blocks=16)
            outs.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0])
            assert model_of(llm).lm_head.quant is None
            llm.shutdown()
    assert outs[0].token_ids == outs[1].token_ids and outs[0].logprobs == outs[1].logprobs


def test_fused_ops_off_resolves_auto_to_dequantized(kernels, monkeypatch: pytest.MonkeyPatch,
                                                    quantized: dict[str, Path]) -> None:
    """PAGEDLLM_FUSED_OPS=0: the layers bind no kernels, so quantization "auto" resolves to None (as the layers
    would dequantize), and the fits-in-memory estimate counts the dequantized weights the engine holds (both ask
    ``cpu_ops.kernels_for``, the layers' own question)."""
    from pagedllm import platform
    from pagedllm.worker import memory_fit

    path = str(quantized["Q4_K"])
    assert EngineArgs(model=path, num_kv_blocks=16).create_engine_config()[0].model.quantization == "gguf"
    try:
        monkeypatch.setenv("PAGEDLLM_FUSED_OPS", "0")
        platform.switches.cache_clear()
        config, arch = EngineArgs(model=path, dtype="float32", num_kv_blocks=16).create_engine_config()
        assert config.model.quantization is None
        llm = LLM(path, dtype="float32", num_kv_blocks=16)
        assert model_of(llm).lm_head.quant is None
        held = llm.llm_engine.rank_memory_usage()[0]["weights_bytes"]
        assert memory_fit.estimate_weight_bytes(path, arch, config).final == held
        llm.shutdown()
    finally:
        monkeypatch.undo()
        platform.switches.cache_clear()


def test_quantization_option_is_checked(tiny_llm_dir: Path, quantized: dict[str, Path]) -> None:
    with pytest.raises(ValidationError, match="quantization") as err:
        LLM(str(tiny_llm_dir), quantization="gguf")
    assert err.value.param == "quantization"
    with pytest.raises(ValidationError, match="quantization"):
        LLM(str(quantized["Q8_0"]), quantization="awq")
    with pytest.raises(ValidationError, match="load_format='dummy'"):  # random weights: nothing to quantize
        LLM(str(tiny_llm_dir), quantization="int8", load_format="dummy")


def test_lora_adapters_keep_quantized_layers_off_the_stack(kernels, tiny_llm_dir: Path) -> None:
    """The compiled stack adds no adapter deltas: with enable_lora, quantized layers run one by one."""
    llm = LLM(str(tiny_llm_dir), quantization="int8", enable_lora=True, dtype="float32", num_kv_blocks=16)
    llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)
    model = model_of(llm)
    llm.shutdown()
    assert model.model.layers[0].mlp.down_proj.quant is not None and model.model._stack is None


def test_auto_keeps_a_gguf_files_formats_where_the_kernels_run(quantized: dict[str, Path], f32_gguf: Path,
                                                                 tiny_llm_dir: Path) -> None:
    """The default, quantization="auto": "gguf" for a file with matrices in a kept format where the compiled kernels
    run; None (every weight dequantized) for a float file, an HF folder, dummy weights, the portable level, and
    quantization=None / --dequantize."""
    import argparse

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from
    from pagedllm.layers import cpu_ops

    def resolved(model: Path, **options: Any) -> str | None:
        return EngineArgs(model=str(model), **options).create_engine_config()[0].model.quantization

    assert EngineArgs().quantization == "auto"
    assert resolved(quantized["Q4_1"]) == ("gguf" if cpu_ops.active() is not None else None)
    for model, options in ((f32_gguf, {}), (tiny_llm_dir, {}), (quantized["Q4_1"], {"load_format": "dummy"}),
                           (quantized["Q4_1"], {"quantization": None})):
        assert resolved(model, **options) is None, (model, options)
    with cpu_ops.use_level("portable"):
        assert resolved(quantized["Q4_1"]) is None
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args([])).quantization == "auto"
    assert engine_args_from(parser.parse_args(["--dequantize"])).quantization is None


@pytest.mark.parametrize("variant", ["llama-gqa-untied", "qwen2-qkv-bias"])
def test_int8_quantization_of_an_hf_checkpoint(kernels, tiny_model, variant: str) -> None:
    """quantization="int8": safetensors weights quantized at load, one scale per output channel, run by the Q8_0
    kernels: every weight within half a step of its row's scale, the logits within 5% of the float model's."""
    from safetensors.torch import load_file

    path = tiny_model(variant)
    seq = torch.randint(3, 500, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    schedule = [[8], [6]] + [[1]] * 7
    want = paged_logits(path, [seq], schedule)[0]
    got = paged_logits(path, [seq], schedule, quantization="int8")[0]
    assert (got - want).abs().max() / want.abs().max() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    llm = LLM(str(path), quantization="int8", dtype="float32", num_kv_blocks=16)
    model = model_of(llm)
    llm.shutdown()
    original = load_file(str(path / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    (piece,) = model.model.layers[0].mlp.down_proj.quant.pieces.values()
    assert piece.type_name == "Q8_0" and piece.packed and model.lm_head.quant is not None
    step = (original.abs().amax(1, keepdim=True) / 127).half().float()  # the scale as stored (f16)
    layer = QuantWeight(*original.shape)
    layer.place(0, int8_rows(original))
    assert ((layer.pieces[0].dequantize() - original).abs() <= step * 0.501).all()


def test_default_model_quantized_against_dequantized(default_model: str, tokenizer: Any) -> None:
    """SmolLM2-135M-Instruct (Q4_1 matrices, Q8_0 embeddings and LM head) quantized against the same file
    dequantized, float32 both. Greedy tokens on 8 prompts: the agreement is printed (measured 0.77); at least
    half of the tokens agree before the first divergence on average, and every first token is the same.
    Perplexity on the shipped public-domain prose (3,133 tokens, windows of 512): within 1% (measured 21.33
    and 21.20; llama.cpp on the file: 21.29)."""
    runs, values, _ = greedy_and_perplexity(default_model, tokenizer, [{"quantization": q, "dtype": "float32"}
                                                                    for q in ("gguf", None)])
    prefix = common_prefixes(*runs)
    agreement = sum(prefix) / (32 * len(prefix))
    print(f"greedy agreement quantized vs dequantized: {agreement:.2f} (common prefixes {prefix}); "
          f"perplexity {values[0]:.3f} vs {values[1]:.3f}")
    assert all(p > 0 for p in prefix) and agreement >= 0.5
    assert 5 < values[1] < 50 and abs(values[0] / values[1] - 1) < 0.01, values


def test_bench_perplexity_command(quantized: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    """`pagedllm bench perplexity` prints one JSON line: the perplexity and how many tokens it scored."""
    import json

    from pagedllm.entrypoints.cli import main

    assert main(["bench", "perplexity", "--file", str(PROSE), "--model", str(quantized["Q4_1"]), "--quantization",
                 "gguf", "--context", "256", "--num-kv-blocks", "64"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    from pagedllm.entrypoints.bench.perplexity import perplexity

    llm = LLM(str(quantized["Q4_1"]), quantization="gguf", num_kv_blocks=16)
    with pytest.raises(ValidationError, match="perplexity needs at least 2") as err:
        perplexity(llm, [5])
    llm.shutdown()
    assert err.value.param == "file"
    assert result["quantization"] == "gguf" and result["context"] == 256
    assert result["perplexity"] > 1 and result["scored_tokens"] == result["tokens"] - -(-result["tokens"] // 256)
