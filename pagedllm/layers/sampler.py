"""The sampler: penalties, min_tokens, temperature, min_p, top_k, top_p, then one draw per row.

Random rows are drawn by inverse-CDF sampling with one uniform number per row; a seeded
request draws its number from its own generator, so its tokens do not depend on what else is
in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pagedllm.layers.cpu_ops import CpuKernels, kernels_for
from pagedllm.outputs import TokenLogprobs


@dataclass(kw_only=True)
class SamplingMetadata:
    """Per-row sampling settings of one step (rows = requests that sample)."""

    temperature: torch.Tensor
    """(rows,) float32; 1.0 on greedy rows (their scaled logits are not used)."""
    greedy: torch.Tensor
    """(rows,) bool."""
    all_greedy: bool
    any_greedy: bool = False
    any_temperature: bool = True
    """Some sampling row has a temperature other than 1."""
    top_k: torch.Tensor | None = None
    """(rows,) int64, vocab size where disabled; None when no row uses it."""
    top_p: torch.Tensor | None = None
    """(rows,) float32, 1.0 where disabled."""
    min_p: torch.Tensor | None = None
    """(rows,) float32, 0.0 where disabled."""
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    """Row -> the request's own generator (requests with a seed)."""
    default_generator: torch.Generator | None = None
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_token_ids: list[list[int]] | None = None
    """Per row, tokens generated so far (only when a penalty is used)."""
    prompt_token_ids: list[list[int]] | None = None
    """Per row, prompt tokens (only when a repetition penalty is used)."""
    blocked_token_ids: dict[int, list[int]] = field(default_factory=dict)
    """Row -> tokens it may not sample (EOS / stop ids before min_tokens, the last token of a bad word)."""
    logit_bias: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Row -> (token ids int64, biases float32) added to its logits."""
    allowed_token_ids: dict[int, torch.Tensor] = field(default_factory=dict)
    """Row -> the only token ids (int64) it may sample."""
    max_num_logprobs: int | None = None
    """Largest top-N asked for by any row; None when no row wants logprobs."""
    num_logprobs: list[int] = field(default_factory=list)
    """Per row, its own top-N (0: none, or its logprob_token_ids instead); empty: every row ranks max_num_logprobs."""
    wants_logprobs: list[bool] = field(default_factory=list)
    logprob_token_ids: dict[int, list[int]] = field(default_factory=dict)
    """Row -> the tokens whose log-probabilities it reports instead of its top-N (logprob_token_ids)."""
    watermark_noise: dict[int, torch.Tensor] = field(default_factory=dict)
    """Row -> (vocab,) float32 Gumbel noise (watermark_config): the row takes the argmax of its processed logits
    plus the noise instead of a random draw (worker/watermark.py)."""


@dataclass(kw_only=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    """(rows,) int64."""
    logprobs: list[TokenLogprobs | None]


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device | None = None) -> torch.Tensor:
    """(rows, vocab) int64 on ``device``: how often each token occurs in each row's list."""
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.int64, device=device)
    width = max((len(t) for t in token_ids), default=0)
    if width:
        padded = torch.full((len(token_ids), width), vocab_size, dtype=torch.int64)  # pad -> spare column
        for row, ids in enumerate(token_ids):
            padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        padded = padded.to(device)  # built on the host, copied once
        counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """vLLM's definitions: repetition (prompt or output tokens), then frequency, then presence."""
    vocab = logits.shape[1]
    if md.repetition_penalty is not None:
        seen = token_counts([p + o for p, o in zip(md.prompt_token_ids, md.output_token_ids)], vocab, logits.device) > 0
        penalty = md.repetition_penalty.unsqueeze(1).expand_as(logits)
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    if md.frequency_penalty is not None or md.presence_penalty is not None:
        counts = token_counts(md.output_token_ids, vocab, logits.device).to(logits.dtype)
        if md.frequency_penalty is not None:
            logits = logits - md.frequency_penalty.unsqueeze(1) * counts
        if md.presence_penalty is not None:
            logits = logits - md.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (-inf) tokens outside the top k, then outside the smallest set of mass >= top_p."""
    if top_k is not None:
        top_k = top_k.clamp(max=logits.shape[1])  # "disabled" rows carry a k beyond the vocabulary
        k_max = int(top_k.max())
        kth = logits.topk(k_max, dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1)  # ascending
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


SAMPLE_CHUNK = 256
"""Vocabulary chunk of the two-level inverse-CDF draw."""


def inverse_cdf_sample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row, the first token whose cumulative weight reaches u * total (u in (0, 1]).

    Two levels: chunk sums pick the chunk, then a cumsum inside that chunk only; a cumsum over
    the whole vocabulary is sequential per row and costs several times more. A token of
    weight 0 is never picked: the first index that reaches a positive target has weight > 0.
    """
    rows, vocab = weights.shape
    pad = -vocab % SAMPLE_CHUNK
    if pad:
        weights = torch.nn.functional.pad(weights, (0, pad))
    chunks = weights.view(rows, -1, SAMPLE_CHUNK)  # (rows, num_chunks, chunk)
    chunk_cdf = chunks.sum(-1).cumsum(-1)  # (rows, num_chunks)
    target = (u * chunk_cdf[:, -1]).unsqueeze(1)  # (rows, 1)
    chunk = torch.searchsorted(chunk_cdf, target).clamp(max=chunk_cdf.shape[1] - 1)  # (rows, 1)
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0)), torch.zeros_like(target))
    inner_cdf = chunks[torch.arange(rows, device=weights.device), chunk.squeeze(1)].cumsum(-1)  # (rows, chunk)
    inner_target = (target - before).clamp(min=torch.finfo(weights.dtype).tiny).minimum(inner_cdf[:, -1:])
    inside = torch.searchsorted(inner_cdf, inner_target).clamp(max=SAMPLE_CHUNK - 1)
    return (chunk * SAMPLE_CHUNK + inside).squeeze(1)


def _plain(md: SamplingMetadata) -> bool:
    """No logprobs, penalties or blocked tokens: the logits are read, never edited."""
    return (md.max_num_logprobs is None and not md.blocked_token_ids and md.repetition_penalty is None
            and md.frequency_penalty is None and md.presence_penalty is None and not md.logit_bias
            and not md.allowed_token_ids)


def _argmax(logits: torch.Tensor, kernels: CpuKernels | None) -> torch.Tensor:
    """(rows,) int64 argmax per row; the compiled one (``kernels``: the sampler's) reads bf16 logits in one
    vectorised pass."""
    if kernels is not None and logits.dim() == 2 and logits.stride(-1) == 1:
        return kernels.argmax(logits)
    return logits.argmax(dim=-1)


def _uniforms(rows: int, md: SamplingMetadata) -> torch.Tensor:
    """(rows,) float32 in (0, 1]: seeded rows from their own generators, the rest from the default."""
    device = md.temperature.device
    u = 1.0 - torch.rand(rows, generator=md.default_generator, device=device)
    for row, generator in md.generators.items():
        u[row] = 1.0 - torch.rand(1, generator=generator, device=device)[0]
    return u


class Sampler(nn.Module):
    """Logits (rows, vocab) float32, bf16 or f16 -> one token per row, and logprobs where asked."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        """``device``: where the logits are; the compiled argmax and draw serve on the CPU where the kernels run
        (chosen here, once: layers/custom_op.py)."""
        super().__init__()
        self.kernels = kernels_for(torch.device(device))

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """``logits`` may be bf16 / f16 (the LM head's dtype): rows that need only a plain draw or
        an argmax are sampled from them directly; anything else works on a float32 copy."""
        if logits.dtype != torch.float32 and not _plain(md):
            logits = logits.float()
        # logprobs are of the model's raw distribution (before penalties and temperature), as vLLM's default
        raw_logprobs = logits.log_softmax(-1) if md.max_num_logprobs is not None else None
        logits = apply_penalties(logits, md)
        for row, (token_ids, biases) in md.logit_bias.items():
            logits[row, token_ids] += biases
        for row, token_ids in md.allowed_token_ids.items():
            allowed = logits[row, token_ids]
            logits[row] = float("-inf")
            logits[row, token_ids] = allowed
        for row, token_ids in md.blocked_token_ids.items():
            logits[row, token_ids] = float("-inf")
        if md.all_greedy:
            sampled = _argmax(logits, self.kernels)
        else:
            greedy = _argmax(logits, self.kernels) if md.any_greedy else None  # before _random_sample reuses logits
            sampled = self._random_sample(logits, md, self.kernels)
            if greedy is not None:
                sampled = torch.where(md.greedy, greedy, sampled)
        logprobs = self._gather_logprobs(raw_logprobs, sampled, md) if raw_logprobs is not None else []
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs or [None] * logits.shape[0])

    @staticmethod
    def _random_sample(logits: torch.Tensor, md: SamplingMetadata, kernels: CpuKernels | None) -> torch.Tensor:
        """One draw per row; overwrites ``logits`` (the caller is done with them)."""
        ops = kernels if logits.dim() == 2 and logits.stride(-1) == 1 else None
        if ops is not None and md.min_p is None and md.top_k is None and md.top_p is None and not md.watermark_noise:
            # temperature, softmax weights and the draw in one pass per row (no (rows, vocab) temporaries)
            return ops.sample(logits, md.temperature if md.any_temperature else None, _uniforms(logits.shape[0], md))
        logits = logits.float()  # bf16 logits: a float32 copy; float32 ones: the caller's tensor itself
        if md.any_temperature:  # rows at temperature 1 need no division
            logits.div_(md.temperature.unsqueeze(1))
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        # watermarked rows: Gumbel-max over the processed logits (before the weights below overwrite them)
        marked = {row: (logits[row] + noise).argmax() for row, noise in md.watermark_noise.items()}
        weights = logits.sub_(logits.max(dim=-1, keepdim=True).values).exp_()  # unnormalised probabilities
        sampled = inverse_cdf_sample(weights, _uniforms(weights.shape[0], md))
        for row, token in marked.items():
            sampled[row] = token
        return sampled

    @staticmethod
    def _gather_logprobs(raw: torch.Tensor, sampled: torch.Tensor, md: SamplingMetadata) -> list[TokenLogprobs | None]:
        gathered = gather_token_logprobs(raw, sampled, md.num_logprobs or md.max_num_logprobs or 0)
        for row, token_ids in md.logprob_token_ids.items():  # these tokens instead of the top-N, with their ranks
            ids = torch.tensor(token_ids, dtype=torch.int64, device=raw.device)
            values = raw[row, ids]  # (k,)
            ranks = _ranks(raw[row], values)
            gathered[row].top_token_ids, gathered[row].top_logprobs = list(token_ids), values.tolist()
            gathered[row].top_ranks = ranks.tolist()
        return [lp if wants else None for lp, wants in zip(gathered, md.wants_logprobs)]


RANKS_BY_COMPARING = 16
"""Up to this many tokens, a row's ranks come from comparing each with the whole row (k x vocab); more, from one
sort of the row and a binary search each (a client's 128 ids would otherwise cost 128 passes over the vocabulary)."""


def _ranks(row: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """1 + how many of ``row``'s (vocab,) log-probabilities exceed each of ``values`` (k,)."""
    if values.numel() <= RANKS_BY_COMPARING:
        return (row.unsqueeze(0) > values.unsqueeze(1)).sum(dim=1) + 1  # (k, vocab) compared
    ascending = row.sort().values
    return row.numel() - torch.searchsorted(ascending, values, right=True) + 1


def _top_per_row(logprobs: torch.Tensor, counts: list[int]) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's top ``counts[row]`` token ids and log-probabilities (rows asking the same count: one topk)."""
    top_ids: list[list[int]] = [[] for _ in counts]
    top_vals: list[list[float]] = [[] for _ in counts]
    distinct = set(counts)
    if len(distinct) == 1:
        if counts[0]:
            top = logprobs.topk(counts[0], dim=-1)
            top_ids, top_vals = top.indices.tolist(), top.values.tolist()
        return top_ids, top_vals
    for k in distinct - {0}:  # a row asking for the whole vocabulary no longer makes every other row rank it too
        rows = [r for r, c in enumerate(counts) if c == k]
        top = logprobs[torch.tensor(rows, device=logprobs.device)].topk(k, dim=-1)
        for r, ids, vals in zip(rows, top.indices.tolist(), top.values.tolist()):
            top_ids[r], top_vals[r] = ids, vals
    return top_ids, top_vals


def gather_token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, top_n: int | list[int]
                          ) -> list[TokenLogprobs]:
    """Per row of ``logprobs`` (rows, vocab): the log-probability and rank of ``tokens[row]`` and the
    row's top ``top_n`` (sampled tokens, and prompt tokens for prompt_logprobs); ``top_n`` a list: each row's
    own count (rows asking the same count share one topk; all alike, the common case, is the one topk of an int)."""
    chosen = logprobs.gather(1, tokens.unsqueeze(1))  # (rows, 1)
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    counts = top_n if isinstance(top_n, list) else [top_n] * len(ranks)
    top_ids, top_vals = _top_per_row(logprobs, counts)
    return [TokenLogprobs(sampled_logprob=c, sampled_rank=r, top_token_ids=ids, top_logprobs=vals)
            for c, r, ids, vals in zip(chosen.squeeze(1).tolist(), ranks, top_ids, top_vals)]
