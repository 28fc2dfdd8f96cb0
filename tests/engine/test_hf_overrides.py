"""hf_overrides (vLLM's --hf-overrides): entries merged into config.json before anything reads it. The workers'
model is built from the merged config (its log-probabilities are transformers' with the same config), the engine's
defaults follow it (max_model_len), nested objects merge, new keys are added as vLLM does (matryoshka_dimensions),
and what cannot apply is refused naming hf_overrides (not a JSON object, a .gguf file)."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ValidationError
from pagedllm.models.loader import merge_hf_overrides

PROMPT = [1, 17, 230, 45, 9, 311, 77]


@pytest.fixture(scope="module")
def folder(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama-gqa-untied")


def _prompt_logprobs(llm: LLM) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([entry[t].logprob for t, entry in zip(PROMPT[1:], out[0].prompt_logprobs[1:])])


def _reference(folder: Path, copy_to: Path, overrides: dict) -> torch.Tensor:
    """transformers' log-probabilities of PROMPT's tokens with ``overrides`` merged into a copy of config.json."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(folder, copy_to)
    config = json.loads((copy_to / "config.json").read_text())
    merge_hf_overrides(config, overrides)
    (copy_to / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(copy_to, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([PROMPT])).logits[0, :-1].log_softmax(-1)
    return logprobs.gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1)


def test_the_model_runs_the_merged_config(folder: Path, tmp_path: Path) -> None:
    """The rope base (nested in rope_parameters) and max_position_embeddings overridden, as a dict and as the
    command line's JSON: the model the workers run is transformers' with that config, and max_model_len defaults
    to the new context length."""
    overrides = {"rope_parameters": {"rope_theta": 50.0}, "max_position_embeddings": 128}
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=32, hf_overrides=overrides)
    assert llm.llm_engine.config.model.max_model_len == 128
    got = _prompt_logprobs(llm)
    assert torch.allclose(got, _reference(folder, tmp_path / "merged", overrides), atol=1e-4)
    assert not torch.allclose(got, _reference(folder, tmp_path / "plain", {}), atol=1e-3)  # (it changed the model)
    from_json = LLM(str(folder), dtype="float32", num_kv_blocks=32, hf_overrides=json.dumps(overrides))
    assert torch.allclose(_prompt_logprobs(from_json), got, atol=1e-5)
    assert json.loads((folder / "config.json").read_text())["max_position_embeddings"] == 512  # the file stays
    older_name = LLM(str(folder), dtype="float32", num_kv_blocks=32, hf_overrides={"rope_theta": 50.0})
    assert torch.allclose(_prompt_logprobs(older_name), got, atol=1e-5)  # (transformers 4's name reaches it too)


def test_nested_objects_merge_and_new_keys_are_added() -> None:
    """An object merges into the object the config holds under its key (recursively); other values replace;
    keys the config lacks are added (vLLM's semantics); the overrides themselves are never shared."""
    config = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "text_config": {"a": {"b": 1, "c": 2}},
              "eos_token_id": 2}
    overrides = {"rope_scaling": {"factor": 4.0}, "text_config": {"a": {"c": 3}}, "eos_token_id": [2, 3],
                 "matryoshka_dimensions": [16, 32]}
    merge_hf_overrides(config, overrides)
    assert config == {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "text_config": {"a": {"b": 1, "c": 3}},
                      "eos_token_id": [2, 3], "matryoshka_dimensions": [16, 32]}
    config["eos_token_id"].append(4)
    assert overrides["eos_token_id"] == [2, 3]
    replaced = {"rope_scaling": None}
    merge_hf_overrides(replaced, {"rope_scaling": {"factor": 2.0}})
    assert replaced == {"rope_scaling": {"factor": 2.0}}


def test_a_key_the_config_lacks_reaches_the_pooler(folder: Path) -> None:
    """vLLM's own test passes {"matryoshka_dimensions": [...]}: an embedder then takes those dimensions."""
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=32, runner="pooling", convert="embed",
              hf_overrides={"matryoshka_dimensions": [16, 32]})
    assert llm.llm_engine.config.model.pooler.matryoshka_dimensions == (16, 32)


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", 5, {1: 2}])
def test_refused_when_not_an_object_of_keys(folder: Path, bad: object) -> None:
    with pytest.raises(ValidationError) as e:
        LLM(str(folder), dtype="float32", num_kv_blocks=32, hf_overrides=bad)
    assert e.value.param == "hf_overrides"


def test_refused_for_a_gguf_file(default_model: str) -> None:
    """A .gguf file's metadata is no config.json: refused naming hf_overrides, before any weight is read."""
    with pytest.raises(ValidationError, match="gguf") as e:
        LLM(default_model, hf_overrides={"rope_theta": 50.0})
    assert e.value.param == "hf_overrides"
