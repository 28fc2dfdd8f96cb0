"""Decoder models as pooling models: a causal LM converted to an embedder (last-token pooling, normalized) and a
decoder classifier (``LlamaForSequenceClassification``), against transformers on the same weights; generation
requests to them are refused naming the endpoint, and the KV pool is clean afterwards."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedllm import LLM
from pagedllm.errors import ValidationError
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from tests.tiny_tokenizer import save_word_tokenizer
from tests.utils import assert_pool_clean

PROMPTS = [[5, 9, 13, 2, 8], [7], list(range(20, 61)), [3, 3, 3, 4]]


def _reference_last_hidden(folder: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0, -1]


def test_causal_lm_converted_to_embedder_matches_transformers(tiny_model: Callable[[str], Path]) -> None:
    folder = tiny_model("llama-gqa-untied")
    llm = LLM(str(folder), dtype="float32", runner="pooling", num_kv_blocks=64)
    try:
        assert llm.llm_engine.config.model.convert == "embed"
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        for ids, out in zip(PROMPTS, outs):
            want = torch.nn.functional.normalize(_reference_last_hidden(folder, ids), dim=0)
            assert torch.nn.functional.cosine_similarity(torch.tensor(out.outputs.embedding), want, dim=0) > 0.99999
            assert out.prompt_token_ids == ids
        raw = llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(normalize=False), use_tqdm=False)[0]
        torch.testing.assert_close(torch.tensor(raw.outputs.embedding), _reference_last_hidden(folder, PROMPTS[0]),
                                   rtol=1e-4, atol=1e-4)
        with pytest.raises(ValidationError, match="/v1/embeddings") as e:
            llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2))
        assert e.value.param == "model"
        assert_pool_clean(llm)
    finally:
        llm.shutdown()


# the activation transformers' loss implies for a config's problem_type (vLLM applies the same)
ACTIVATIONS = {None: lambda x: x.softmax(-1), "single_label_classification": lambda x: x.softmax(-1),
               "multi_label_classification": torch.sigmoid, "regression": lambda x: x}


@pytest.mark.parametrize("problem_type", list(ACTIVATIONS))
def test_decoder_classifier_matches_transformers(tmp_path: Path, problem_type: str | None) -> None:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0,
                         id2label={0: "neg", 1: "neu", 2: "pos"}, label2id={"neg": 0, "neu": 1, "pos": 2},
                         problem_type=problem_type)
    torch.manual_seed(0)
    ref = LlamaForSequenceClassification(config).eval()
    ref.save_pretrained(tmp_path / "cls")
    save_word_tokenizer(tmp_path / "cls", 128)
    llm = LLM(str(tmp_path / "cls"), dtype="float32", num_kv_blocks=64)
    try:
        model = llm.llm_engine.config.model
        assert (model.runner, model.convert, model.labels, model.pooling_tasks) == (
            "pooling", "classify", ("neg", "neu", "pos"), ("classify",))
        prompts = [[5, 9, 13, 2], [7, 1], list(range(10, 40))]
        outs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        raw = llm.classify([{"prompt_token_ids": p} for p in prompts], PoolingParams(use_activation=False),
                           use_tqdm=False)
        for ids, out, logits in zip(prompts, outs, raw):
            with torch.no_grad():
                want = ref(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(torch.tensor(logits.outputs.probs), want, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(torch.tensor(out.outputs.probs), ACTIVATIONS[problem_type](want), rtol=1e-4,
                                       atol=1e-5)
        rewards = llm.reward([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)  # the raw head outputs
        assert [r.outputs.data for r in rewards] == [r.outputs.probs for r in raw]
        with pytest.raises(ValidationError) as e:  # three labels: no single score
            llm.score("a", "b")
        assert e.value.param == "model"
        with pytest.raises(ValidationError) as e:
            llm.embed({"prompt_token_ids": prompts[0]})
        assert e.value.param == "task"
        assert_pool_clean(llm)
    finally:
        llm.shutdown()
