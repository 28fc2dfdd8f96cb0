"""GGUF files quantized by llama.cpp itself (llama_model_quantize; tests/data/make_llamacpp_quantized.py made them
from a tiny random Llama and says how), not by the tests' numpy quantizers: Q4_K_M and Q5_K_M, llama.cpp choosing
each tensor's format. With quantization="gguf", at the lowest and highest kernel level this CPU runs, every matrix
is kept in the file's format, every kept row as the kernels read it equals the gguf package's dequantization, and
greedy tokens equal the same file's dequantized model's up to near ties; that dequantized model's greedy tokens
are transformers' on the file (which the gguf package dequantizes too)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.quant import QuantWeight
from tests.utils import end_levels, model_of

DATA = Path(__file__).resolve().parents[1] / "data"
FILE_TYPES = ["Q4_K_M", "Q5_K_M"]
TOKENS = 12
TIE = 0.06
"""A near tie, in nats: at the first token where the two models part, each one's pick is the other's runner-up
within this. Measured on 24 prompts of 16 tokens: 10 (Q4_K_M) and 14 (Q5_K_M) of 24 equal, the others part at
gaps of 0.001-0.039 nats (the int8 activations move the logits by ~2% of their largest)."""
DRIFT = 0.1
"""Before they part, each token's log-probability under the two models differs by at most this (nats)."""


def _layout(main: str) -> dict[str, list[str]]:
    """The formats llama.cpp's Q4_K_M / Q5_K_M give this 2-layer model (``main`` Q4_K / Q5_K; Q6_K for the LM head
    and the last layer's attn_v and ffn_down), as each layer keeps them: its segments in row order."""
    layout = {"model.embed_tokens": [main], "lm_head": ["Q6_K"], "model.layers.0.self_attn.qkv_proj": [main],
              "model.layers.1.self_attn.qkv_proj": [main, "Q6_K"],  # q|k, v
              "model.layers.0.mlp.down_proj": [main], "model.layers.1.mlp.down_proj": ["Q6_K"]}
    return layout | {f"model.layers.{i}.{name}": [main] for i in (0, 1) for name in ("self_attn.o_proj",
                                                                                        "mlp.gate_up_proj")}


LAYOUTS = {"Q4_K_M": _layout("Q4_K"), "Q5_K_M": _layout("Q5_K")}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 320, (n,), generator=g).tolist() for n in (3, 9, 17, 5, 11, 23, 2, 30)]


def _generate(path: Path, quantization: str | None) -> tuple[list[Any], torch.nn.Module]:
    """Greedy outputs (top-2 log-probabilities) of the prompts, and the model that made them."""
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
    llm = LLM(str(path), quantization=quantization, dtype="float32", num_kv_blocks=32)
    outs = [out.outputs[0] for out in llm.generate([{"prompt_token_ids": p} for p in _prompts()], params,
                                                   use_tqdm=False)]
    model = model_of(llm)
    llm.shutdown()
    return outs, model


@pytest.fixture(scope="module")
def dequantized() -> dict[str, list[Any]]:
    """Each file's greedy outputs with every weight dequantized (quantization=None)."""
    return {name: _generate(DATA / f"tiny-llama-{name}.gguf", None)[0] for name in FILE_TYPES}


@pytest.mark.parametrize("kernels", end_levels(), indirect=True)
@pytest.mark.parametrize("name", FILE_TYPES)
def test_llamacpp_k_quants_are_kept_and_read_as_gguf_dequantizes_them(kernels, name: str,
                                                                       dequantized: dict[str, list[Any]]) -> None:
    from pagedllm.models.loader.gguf_loader import iter_weights, load_arch_config

    path = DATA / f"tiny-llama-{name}.gguf"
    got, model = _generate(path, "gguf")
    reference = dict(iter_weights(str(path), load_arch_config(str(path))))  # HF name -> float32, by gguf
    layout = {}
    for module_name, module in model.named_modules():
        quant = getattr(module, "quant", None)
        if not isinstance(quant, QuantWeight):
            continue
        layout[module_name] = [piece.type_name for _, piece in sorted(quant.pieces.items())]
        prefix, _, last = module_name.rpartition(".")
        parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}.get(last)
        want = torch.cat([reference[f"{prefix}.{p}.weight"] for p in parts]) if parts \
            else reference[f"{module_name}.weight"]  # (rows, cols) in the layer's row order
        for offset, piece in quant.pieces.items():
            rows = quant.kernels.qrows(piece, torch.arange(piece.rows), torch.float32)  # (piece rows, cols)
            assert torch.allclose(rows, want[offset:offset + piece.rows], rtol=1e-6, atol=1e-7), (module_name, offset)
    print(f"{name} at {kernels.level}: {layout}")
    assert layout == LAYOUTS[name]

    equal = 0
    for kept, deq in zip(got, dequantized[name]):
        part = next((i for i, (a, b) in enumerate(zip(kept.token_ids, deq.token_ids)) if a != b), None)
        for i in range(TOKENS if part is None else part):
            token = kept.token_ids[i]
            assert abs(kept.logprobs[i][token].logprob - deq.logprobs[i][token].logprob) < DRIFT, (i, token)
        if part is None:
            equal += 1
            continue
        for mine, other in ((kept, deq), (deq, kept)):  # each model's pick is the other's near runner-up
            top = {token: lp.logprob for token, lp in mine.logprobs[part].items()}
            runner_up = other.token_ids[part]
            assert runner_up in top and top[mine.token_ids[part]] - top[runner_up] < TIE, (part, runner_up, top)
    assert equal >= len(got) // 2, f"{equal} of {len(got)} greedy sequences equal"


@pytest.mark.parametrize("name", FILE_TYPES)
def test_the_dequantized_file_is_transformers_model(name: str, dequantized: dict[str, list[Any]]) -> None:
    """transformers on the file (its GGUF loader dequantizes by the gguf package): the same greedy tokens as ours
    dequantized, and the same logits along them (float32 both)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(DATA), gguf_file=f"tiny-llama-{name}.gguf",
                                                 dtype=torch.float32).eval()
    for prompt, ours in zip(_prompts(), dequantized[name]):
        ids = torch.tensor([prompt + list(ours.token_ids)])  # (1, prompt + generated)
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1]  # (TOKENS, vocab): the logits each token came from
        assert logits.argmax(-1).tolist() == list(ours.token_ids)
        logprobs = torch.log_softmax(logits, -1)
        for i, token in enumerate(ours.token_ids):
            assert abs(logprobs[i, token].item() - ours.logprobs[i][token].logprob) < 1e-3, (i, token)
