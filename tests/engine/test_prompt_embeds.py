"""Prompts given as embeddings (enable_prompt_embeds): the model's own embeddings of some token ids generate what
those ids generate; the prefix cache never matches them by their placeholder ids; bad payloads are refused naming
prompt_embeds."""
from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pagedllm import SamplingParams
from pagedllm.engine.prompt_embeds import decode_prompt_embeds, encode_prompt_embeds, prompt_embeds_from_tensor
from pagedllm.errors import ValidationError
from pagedllm.worker.input_batch import embeds_tensor

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
IDS = [(i * 37 + 11) % 400 + 5 for i in range(40)]  # 2 full blocks of 16 and a tail


def embeddings_of(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """The tiny model's input embeddings of ``ids`` (its embed_tokens rows), (len(ids), hidden) float32."""
    weights = load_file(str(model_dir / "model.safetensors"))
    return weights["model.embed_tokens.weight"][torch.tensor(ids)].float()


@pytest.fixture(scope="module")
def llm(make_llm: Any) -> Any:
    return make_llm(enable_prompt_embeds=True, num_kv_blocks=64)


def test_embeddings_of_ids_generate_what_the_ids_do(llm: Any, tiny_llm_dir: Path) -> None:
    embeds = embeddings_of(tiny_llm_dir, IDS)
    [want] = llm.generate({"prompt_token_ids": IDS}, GREEDY, use_tqdm=False)
    # the placeholder ids' prompt first: a cache keyed by placeholder ids would hand its blocks to the embeds prompt
    llm.generate({"prompt_token_ids": [0] * len(IDS)}, GREEDY, use_tqdm=False)
    outs = llm.generate([{"prompt_embeds": embeds}, {"prompt_embeds": embeds.to(torch.bfloat16).float()},
                         {"prompt_token_ids": IDS}, {"prompt_embeds": embeds.unsqueeze(0)}], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want.outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == want.outputs[0].token_ids
    assert outs[3].outputs[0].token_ids == want.outputs[0].token_ids  # (1, tokens, hidden) taken as (tokens, hidden)
    assert outs[0].outputs[0].text == want.outputs[0].text
    # again: now its blocks are cached under its embeddings' digest, and found
    [again] = llm.generate({"prompt_embeds": embeds}, GREEDY, use_tqdm=False)
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    assert again.num_cached_tokens >= 32
    # n > 1 samples fork from the embedded prompt
    [forked] = llm.generate({"prompt_embeds": embeds}, SamplingParams(n=2, temperature=0.0, max_tokens=4),
                            use_tqdm=False)
    assert [c.token_ids for c in forked.outputs] == [want.outputs[0].token_ids[:4]] * 2


def test_an_embeds_prompt_never_matches_cached_placeholder_ids(make_llm: Any, tiny_llm_dir: Path) -> None:
    llm = make_llm(enable_prompt_embeds=True, num_kv_blocks=64)
    zeros = [0] * len(IDS)
    [from_ids] = llm.generate({"prompt_token_ids": zeros}, GREEDY, use_tqdm=False)
    [from_embeds] = llm.generate({"prompt_embeds": embeddings_of(tiny_llm_dir, IDS)}, GREEDY, use_tqdm=False)
    assert from_embeds.num_cached_tokens == 0
    [want] = llm.generate({"prompt_token_ids": IDS}, GREEDY, use_tqdm=False)
    assert from_embeds.outputs[0].token_ids == want.outputs[0].token_ids != from_ids.outputs[0].token_ids


def test_chunked_and_preempted_embeds_prompts_keep_their_tokens(make_llm: Any, tiny_llm_dir: Path) -> None:
    """Prompts split over steps (a 16-token budget) and preempted (a pool of 8 blocks for four
    sequences of 4 blocks) feed the right rows after each resume."""
    llm = make_llm(enable_prompt_embeds=True, num_kv_blocks=8, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = [[(t + 7 * k) % 400 + 5 for t in IDS] for k in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    got = llm.generate([{"prompt_embeds": embeddings_of(tiny_llm_dir, p)} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    assert llm.get_stats().num_preemptions > 0


@pytest.mark.parametrize(("prompt", "params", "param", "match"), [
    (lambda h: {"prompt_embeds": torch.zeros(3, 7)}, GREEDY, "prompt_embeds", "hidden size 7"),
    (lambda h: {"prompt_embeds": torch.zeros(2, 3, h)}, GREEDY, "prompt_embeds", "2-D"),
    (lambda h: {"prompt_embeds": torch.zeros(3, h, dtype=torch.int32)}, GREEDY, "prompt_embeds", "dtype int32"),
    (lambda h: {"prompt_embeds": torch.zeros(0, h)}, GREEDY, "prompt_embeds", "0 rows"),
    (lambda h: {"prompt_embeds": torch.zeros(10_000, h)}, GREEDY, "prompt_embeds", "max_model_len"),
    (lambda h: {"prompt_embeds": torch.full((3, h), float("nan"))}, GREEDY, "prompt_embeds", "NaN"),
    (lambda h: {"prompt_embeds": [[0.0] * h]}, GREEDY, "prompt_embeds", "torch tensor"),
    (lambda h: {"prompt_embeds": torch.zeros(3, h), "prompt_token_ids": [1]}, GREEDY, "prompt_token_ids",
     "one or the other"),
    (lambda h: {"prompt_embeds": torch.zeros(3, h)}, SamplingParams(prompt_logprobs=1), "prompt_logprobs",
     "not compatible"),
])
def test_bad_prompt_embeds_are_refused_naming_the_field(llm: Any, prompt: Any, params: SamplingParams,
                                                        param: str, match: str) -> None:
    with pytest.raises(ValidationError, match=match) as e:
        llm.generate(prompt(llm.llm_engine.processor.embeds_hidden_size), params, use_tqdm=False)
    assert e.value.param == param


def test_without_the_option_prompt_embeds_are_refused(make_llm: Any, tiny_llm_dir: Path) -> None:
    llm = make_llm(num_kv_blocks=16)
    with pytest.raises(ValidationError, match="enable_prompt_embeds") as e:
        llm.generate({"prompt_embeds": embeddings_of(tiny_llm_dir, IDS[:4])}, GREEDY, use_tqdm=False)
    assert e.value.param == "prompt_embeds"


def test_decode_bounds_and_refuses_payloads() -> None:
    dense = torch.randn(4, 8)
    for layout in (dense, dense.to_sparse_coo(), dense.to_sparse_csr()):
        got = decode_prompt_embeds(encode_prompt_embeds(layout), max_tokens=16)
        assert torch.equal(embeds_tensor(got), dense)
    bf16 = decode_prompt_embeds(encode_prompt_embeds(dense.bfloat16()), max_tokens=16)
    assert bf16.dtype == "bfloat16" and torch.equal(embeds_tensor(bf16), dense.bfloat16())
    # a sparse tensor naming a huge shape is refused before it is made dense
    huge = torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([1.0]), (10**9, 10))
    with pytest.raises(ValidationError, match="rows"):
        decode_prompt_embeds(encode_prompt_embeds(huge), max_tokens=16)
    wide = torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([1.0]), (4, 10**10))
    with pytest.raises(ValidationError, match="hidden size 10000000000"):
        decode_prompt_embeds(encode_prompt_embeds(wide), max_tokens=16, hidden_size=8)
    for payload, match in (("invalid_base64", "base64"), ("", "empty"),
                           (base64.b64encode(b"not a tensor file").decode(), "could not be loaded")):
        with pytest.raises(ValidationError, match=match) as e:
            decode_prompt_embeds(payload, max_tokens=16)
        assert e.value.param == "prompt_embeds"
    buffer = io.BytesIO()
    torch.save({"a": torch.zeros(2, 2)}, buffer)  # loads (weights_only) but is not a tensor
    with pytest.raises(ValidationError, match="torch tensor"):
        decode_prompt_embeds(base64.b64encode(buffer.getvalue()), max_tokens=16)
    with pytest.raises(ValidationError, match="could not be loaded"):  # weights_only: no code runs
        buffer = io.BytesIO()
        torch.save(_Evil(), buffer)
        decode_prompt_embeds(base64.b64encode(buffer.getvalue()), max_tokens=16)


class _Evil:
    def __reduce__(self) -> tuple:
        return (print, ("this must not run",))


def test_prompt_embeds_digest_keys_the_bytes() -> None:
    a = prompt_embeds_from_tensor(torch.ones(2, 4), 8)
    assert a.digest == prompt_embeds_from_tensor(torch.ones(2, 4), 8).digest
    assert a.digest != prompt_embeds_from_tensor(torch.ones(4, 2), 8).digest
    assert a.digest != prompt_embeds_from_tensor(torch.ones(2, 4, dtype=torch.bfloat16), 8).digest


def test_the_option_is_refused_where_it_cannot_work(make_llm: Any) -> None:
    with pytest.raises(ValidationError, match="speculative_config") as e:
        make_llm(enable_prompt_embeds=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert e.value.param == "enable_prompt_embeds"


@pytest.mark.parametrize("variant, table", [("gpt2", "transformer.wte.weight"),
                                            ("opt-350m-style", "model.decoder.embed_tokens.weight")])
def test_models_with_position_embeddings_take_prompt_embeds(tiny_model: Any, variant: str, table: str) -> None:
    """GPT-2 and OPT (vLLM's prompt-embeds test model): the token embeddings of some ids (OPT-350m's before its
    projection in, of word_embed_proj_dim) generate what the ids do; the positions' own embeddings are added to them
    as to the ids'."""
    from pagedllm import LLM

    folder = tiny_model(variant)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, enable_prompt_embeds=True)
    ids = [(i * 37 + 11) % 400 + 5 for i in range(20)]
    embeds = load_file(str(folder / "model.safetensors"))[table][torch.tensor(ids)].float()
    if variant.startswith("opt"):
        assert embeds.shape[1] == 32  # (word_embed_proj_dim, not hidden_size)
    [want, got] = llm.generate([{"prompt_token_ids": ids}, {"prompt_embeds": embeds}], GREEDY, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    with pytest.raises(ValidationError, match="prompt_embeds"):  # the hidden width where the embeddings' is asked
        llm.generate({"prompt_embeds": torch.zeros(4, embeds.shape[1] + 1)}, GREEDY, use_tqdm=False)
    llm.shutdown()
