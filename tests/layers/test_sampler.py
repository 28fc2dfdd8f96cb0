"""Sampler: allowed sets of top-k / top-p / min-p, exact penalties, seeds independent of the batch."""
from __future__ import annotations

import torch

from pagedllm.layers.sampler import Sampler, SamplingMetadata, apply_penalties, apply_top_k_top_p
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import CachedRequestState, build_sampling_metadata

VOCAB = 12


def _state(i: int, params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
           ) -> CachedRequestState:
    prompt = prompt or [1, 2, 3]
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return CachedRequestState(req_id=str(i), token_ids=prompt + (output or []), num_prompt_tokens=len(prompt),
                              sampling_params=params, generator=gen)


def _draw(logits: torch.Tensor, params: SamplingParams, draws: int) -> set[int]:
    """Tokens picked over ``draws`` rows sampled with the same params and logits."""
    states = [_state(i, params) for i in range(draws)]
    md = build_sampling_metadata(states, torch.Generator().manual_seed(0), eos_token_ids=())
    return set(Sampler()(logits.expand(draws, -1).clone(), md).sampled_token_ids.tolist())


def _logits() -> torch.Tensor:
    return torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0, 1.5, 2.2]])


def test_greedy_is_argmax() -> None:
    assert _draw(_logits(), SamplingParams(temperature=0.0), 8) == {0}


def test_top_k_never_leaves_the_k_best() -> None:
    picked = _draw(_logits(), SamplingParams(temperature=5.0, top_k=3), 3000)
    assert picked == {0, 1, 11}  # the 3 largest logits, each drawn at this high temperature


def test_top_p_never_leaves_the_nucleus() -> None:
    logits = _logits()
    probs = (logits / 2.0).softmax(-1)[0]
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    nucleus = set(order[: int((cum < 0.6).sum()) + 1].tolist())  # smallest set with mass >= 0.6
    picked = _draw(logits, SamplingParams(temperature=2.0, top_p=0.6), 3000)
    assert picked == nucleus, (picked, nucleus)


def test_min_p_never_picks_unlikely_tokens() -> None:
    logits = _logits()
    probs = logits.softmax(-1)[0]
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    picked = _draw(logits, SamplingParams(temperature=1.0, min_p=0.3), 3000)
    assert picked == allowed and len(allowed) > 1


def test_top_k_top_p_mask_directly() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [0.0, 0.0, 10.0, 0.0]])
    out = apply_top_k_top_p(logits.clone(), top_k=torch.tensor([2, 4]), top_p=torch.tensor([1.0, 0.5]))
    assert torch.isinf(out[0]).tolist() == [True, False, False, True]
    assert torch.isinf(out[1]).tolist() == [True, True, False, True]


def test_penalties_change_logits_exactly() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    md = SamplingMetadata(temperature=torch.ones(1), greedy=torch.zeros(1, dtype=torch.bool), all_greedy=False,
                          presence_penalty=torch.tensor([0.5]), frequency_penalty=torch.tensor([0.25]),
                          repetition_penalty=torch.tensor([2.0]),
                          prompt_token_ids=[[0]], output_token_ids=[[1, 1, 3]])
    out = apply_penalties(logits.clone(), md)
    # token 0: prompt only -> repetition 2.0 / 2; token 1: output twice -> -1*2 - 0.25*2 - 0.5
    # token 2: unseen; token 3: output once -> 3/2 - 0.25 - 0.5; token 4 unseen
    expected = torch.tensor([[1.0, -2.0 - 0.5 - 0.5, 0.5, 1.5 - 0.25 - 0.5, -2.0]])
    torch.testing.assert_close(out, expected)


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]])  # eos=2 best, stop id 3 second
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    md = build_sampling_metadata([_state(0, params, output=[4])], torch.Generator(), eos_token_ids=(2,))
    assert Sampler()(logits.clone(), md).sampled_token_ids.tolist() == [4]
    md = build_sampling_metadata([_state(0, params, output=[4, 4])], torch.Generator(), eos_token_ids=(2,))
    assert Sampler()(logits.clone(), md).sampled_token_ids.tolist() == [2]


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [_state(0, seeded)]
    tokens_alone = Sampler()(logits[:1].clone(), build_sampling_metadata(
        alone, torch.Generator().manual_seed(0), None)).sampled_token_ids.tolist()
    others = [_state(i, SamplingParams(temperature=1.0, top_k=5 + i)) for i in range(1, 6)]
    batch = others[:3] + [_state(0, seeded)] + others[3:]
    rows = torch.cat([logits[1:4], logits[:1], logits[4:]])
    tokens_batch = Sampler()(rows.clone(), build_sampling_metadata(
        batch, torch.Generator().manual_seed(99), None)).sampled_token_ids.tolist()
    assert tokens_batch[3] == tokens_alone[0]


def test_logprobs_rank_and_top_n() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0.0, logprobs=2)
    md = build_sampling_metadata([_state(0, params)], torch.Generator(), None)
    out = Sampler()(logits.clone(), md)
    lp = out.logprobs[0]
    ref = logits.log_softmax(-1)[0]
    assert out.sampled_token_ids.tolist() == [1] and lp.sampled_rank == 1
    assert lp.top_token_ids == [1, 2]
    assert abs(lp.sampled_logprob - ref[1].item()) < 1e-6


def test_inverse_cdf_sample_follows_the_weights() -> None:
    """Empirical frequencies match the weights; zero-weight tokens (also at chunk edges) never appear."""
    from pagedllm.layers.sampler import SAMPLE_CHUNK, inverse_cdf_sample

    vocab = 3 * SAMPLE_CHUNK + 17
    weights = torch.zeros(vocab)
    allowed = [0, SAMPLE_CHUNK - 1, SAMPLE_CHUNK, 2 * SAMPLE_CHUNK + 5, vocab - 1]
    weights[allowed] = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    draws = 20000
    u = 1.0 - torch.rand(draws, generator=torch.Generator().manual_seed(0))
    picked = inverse_cdf_sample(weights.expand(draws, -1).clone(), u)
    counts = torch.bincount(picked, minlength=vocab)
    assert set(torch.nonzero(counts).flatten().tolist()) == set(allowed)
    expected = weights / weights.sum() * draws
    assert ((counts.float() - expected).abs()[allowed] < 5 * expected[allowed].sqrt() + 5).all()
    edge = inverse_cdf_sample(weights.expand(2, -1).clone(), torch.tensor([1.0, 1e-12]))
    assert edge.tolist() == [vocab - 1, 0]


def test_listed_token_ranks_agree_by_comparing_and_by_sorting() -> None:
    """logprob_token_ids' ranks: the sort-and-search path (many ids) gives the comparing path's ranks, ties too."""
    from pagedllm.layers.sampler import RANKS_BY_COMPARING, _ranks

    torch.manual_seed(0)
    row = torch.randn(4096).log_softmax(-1)
    row[:8] = row[8]  # ties: equal values share the rank of 1 + those strictly above
    ids = torch.randint(0, 4096, (RANKS_BY_COMPARING * 4,))
    ids[:3] = torch.tensor([0, 1, 8])
    values = row[ids]
    compared = (row.unsqueeze(0) > values.unsqueeze(1)).sum(dim=1) + 1
    assert torch.equal(_ranks(row, values), compared)
    assert torch.equal(_ranks(row, values[:RANKS_BY_COMPARING]), compared[:RANKS_BY_COMPARING])
