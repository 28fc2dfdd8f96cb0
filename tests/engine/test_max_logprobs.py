"""max_logprobs (vLLM's --max-logprobs) and a request's logprobs / prompt_logprobs of -1 ("every token"): the bound
follows the engine option (default 20, -1 the vocabulary size), over it is refused in vLLM's words naming the field,
and -1 returns the whole vocabulary's log-probabilities, equal to transformers' log-softmax."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.errors import ValidationError

VOCAB = 512  # the tiny_model fixture's
PROMPT = [1, 17, 230, 45, 9, 311]


@pytest.fixture(scope="module")
def folder(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama-gqa-untied")


@pytest.fixture(scope="module")
def every_token(folder: Path) -> LLM:
    """max_logprobs=-1: any count up to the whole vocabulary."""
    return LLM(str(folder), dtype="float32", max_logprobs=-1, num_kv_blocks=32)


def _refused(llm: LLM, params: SamplingParams) -> ValidationError:
    with pytest.raises(ValidationError) as e:
        llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    return e.value


def test_minus_one_lists_the_whole_vocabulary(every_token: LLM, folder: Path) -> None:
    """logprobs=-1 and prompt_logprobs=-1: every token of the vocabulary at each position, with the values and
    ranks of transformers' log-softmax; the caller's SamplingParams keep their -1."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=2, temperature=0, logprobs=-1, prompt_logprobs=-1)
    out = every_token.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert params.logprobs == -1 and params.prompt_logprobs == -1
    sample = out.outputs[0]
    assert [len(entry) for entry in sample.logprobs] == [VOCAB, VOCAB]
    assert out.prompt_logprobs[0] is None and all(len(e) == VOCAB for e in out.prompt_logprobs[1:])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([PROMPT + sample.token_ids[:1]])).logits[0].log_softmax(-1)
    for pos, entry in enumerate(out.prompt_logprobs[1:]):
        got = torch.tensor([entry[t].logprob for t in range(VOCAB)])
        assert torch.allclose(got, want[pos], atol=1e-4)
        assert sorted(lp.rank for lp in entry.values()) == list(range(1, VOCAB + 1))
    first = sample.logprobs[0]
    assert torch.allclose(torch.tensor([first[t].logprob for t in range(VOCAB)]), want[len(PROMPT) - 1], atol=1e-4)


def test_a_count_above_the_vocabulary_lists_it_all(every_token: LLM) -> None:
    """max_logprobs -1 resolves to the vocabulary size; a count the bound allows lists at most the vocabulary."""
    assert every_token.llm_engine.config.model.max_logprobs == VOCAB
    err = _refused(every_token, SamplingParams(max_tokens=1, logprobs=VOCAB + 1))
    assert err.param == "logprobs"
    assert str(err).startswith(f"Requested sample logprobs of {VOCAB + 1}, which is greater than max allowed: {VOCAB}")


def test_default_bound_and_minus_one_refused(folder: Path) -> None:
    """The default (20) as vLLM: 21 refused in vLLM's words naming the field, -1 too (the vocabulary is larger);
    20 and 0 served; beam search's 2 x beam_width is bounded by the same option."""
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=32)
    assert llm.llm_engine.config.model.max_logprobs == 20
    for params, name, words in ((SamplingParams(logprobs=21), "logprobs", "sample logprobs of 21"),
                                (SamplingParams(prompt_logprobs=21), "prompt_logprobs", "prompt logprobs of 21"),
                                (SamplingParams(logprobs=-1), "logprobs", f"sample logprobs of {VOCAB}"),
                                (SamplingParams(prompt_logprobs=-1), "prompt_logprobs", f"prompt logprobs of {VOCAB}")):
        err = _refused(llm, params)
        assert err.param == name and f"Requested {words}, which is greater than max allowed: 20" in str(err)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, logprobs=20, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert 20 <= len(out.outputs[0].logprobs[0]) <= 21 and all(len(e) == 1 for e in out.prompt_logprobs[1:])


def test_configured_bound(folder: Path) -> None:
    """max_logprobs=5: 5 served, 6 refused; beam_width up to 5 // 2; values below -1 refused at start-up."""
    from pagedllm.sampling_params import BeamSearchParams

    llm = LLM(str(folder), dtype="float32", max_logprobs=5, num_kv_blocks=32)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, logprobs=5), use_tqdm=False)[0]
    assert 5 <= len(out.outputs[0].logprobs[0]) <= 6
    assert _refused(llm, SamplingParams(logprobs=6)).param == "logprobs"
    assert len(llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=2, max_tokens=2),
                               use_tqdm=False)) == 1
    with pytest.raises(ValidationError) as e:
        llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=3, max_tokens=2), use_tqdm=False)
    assert e.value.param == "beam_width"
    for bad in (-2, "20", 1.5):
        with pytest.raises(ValidationError) as e:
            LLM(str(folder), dtype="float32", max_logprobs=bad, num_kv_blocks=32)
        assert e.value.param == "max_logprobs"


def test_sampling_params_take_minus_one_only() -> None:
    """-1 is the one negative count (vLLM's); -2 is refused naming the field."""
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValidationError) as e:
            SamplingParams(**{name: -2})
        assert e.value.param == name


def test_a_row_keeps_its_own_top_n(every_token: LLM) -> None:
    """Beside a request asking for the whole vocabulary, another keeps its own count: the sampler ranks each row
    to its own top-N (gather_token_logprobs with per-row counts: the same lists as one topk of that count, a row
    asking none lists none), and so is what it gets."""
    from pagedllm.layers.sampler import gather_token_logprobs

    logprobs = torch.randn(4, VOCAB).log_softmax(-1)
    tokens = torch.tensor([3, 9, 27, 81])
    own = gather_token_logprobs(logprobs, tokens, [VOCAB, 2, 0, 2])
    alike = gather_token_logprobs(logprobs, tokens, 2)
    assert [len(r.top_token_ids) for r in own] == [VOCAB, 2, 0, 2]
    for r in (1, 3):
        assert own[r].top_token_ids == alike[r].top_token_ids and own[r].top_logprobs == alike[r].top_logprobs
    assert [(r.sampled_logprob, r.sampled_rank) for r in own] == [(r.sampled_logprob, r.sampled_rank) for r in alike]
    assert gather_token_logprobs(logprobs, tokens, [2, 2, 2, 2])[0].top_token_ids == alike[0].top_token_ids
    outs = every_token.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:3]}],
                                [SamplingParams(max_tokens=3, logprobs=-1), SamplingParams(max_tokens=3, logprobs=2)],
                                use_tqdm=False)
    assert all(len(entry) == VOCAB for entry in outs[0].outputs[0].logprobs)
    assert all(2 <= len(entry) <= 3 for entry in outs[1].outputs[0].logprobs)


def test_make_requests_resolves_logprobs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """make_requests checks and resolves a request's logprobs once (check_params no longer resolves them again);
    -1 still becomes the vocabulary size, and prepare (the preparation thread's early checks) still refuses a
    count over max_logprobs."""
    from pagedllm.engine.request_factory import RequestFactory

    processor = RequestFactory(None, 64, VOCAB, (2,), max_logprobs=VOCAB)
    calls = []
    resolve = RequestFactory.resolve_logprobs
    monkeypatch.setattr(RequestFactory, "resolve_logprobs", lambda self, p: calls.append(p) or resolve(self, p))
    requests = processor.make_requests(["0:a", "1:a"], PROMPT, SamplingParams(n=2, logprobs=-1, max_tokens=4))
    assert len(calls) == 1
    assert all(r.sampling_params.logprobs == VOCAB for r in requests)
    small = RequestFactory(None, 64, VOCAB, (2,), max_logprobs=5)
    with pytest.raises(ValidationError) as e:
        small.prepare(SamplingParams(logprobs=6))
    assert e.value.param == "logprobs"
