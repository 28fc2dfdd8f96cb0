"""Per-request state kept by a worker across steps, and the flat batch (``StepInputs``) built from it each step."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pagedllm.attention.base import StepInputs
from pagedllm.layers.sampler import SamplingMetadata
from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.prompt_embeds import PromptEmbeds
from pagedllm.sampling_params import SamplingParams, thinking_budget_forced_token

logger = logging.getLogger(__name__)


class StepFailures(dict[str, str]):
    """The requests one step failed alone, request id -> why (their seed, grammar, logits processors, pooling
    head); made by each step and returned in its ``ModelRunnerOutput.failed``, the step goes on without them."""

    def add(self, req_id: str, stage: str, error: Exception) -> None:
        """Record ``req_id`` as failed at ``stage`` (logged with its traceback)."""
        logger.warning("request %s failed while %s: %r", req_id, stage, error, exc_info=True)
        self[req_id] = f"{stage} failed: {type(error).__name__}: {error}"


@dataclass(kw_only=True)
class CachedRequestState:
    """What a worker remembers about a request between steps (kept across preemption)."""

    req_id: str
    token_ids: list[int]
    """Prompt + tokens sampled so far."""
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    matcher: Any = None
    """The structured-output grammar matcher (xgrammar), fed every token this request sampled (with
    grammar_after_reasoning: those after its reasoning's end; asleep until then)."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter it runs with."""
    pooling_params: PoolingParams | None = None
    """A pooling request's parameters (its hidden states are pooled, not sampled)."""
    token_type_ids: list[int] | None = None
    """Per prompt token, its segment (cross-encoder pairs); None: all 0."""
    prompt_embeds: torch.Tensor | None = None
    """(num_prompt_tokens, hidden) CPU: a prompt given as embeddings, fed instead of its placeholder ids' rows."""
    watermark_seen: Any = None
    """With a watermark that skips repeated contexts: the contexts its history holds (worker/watermark.py)."""

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


def build_step_inputs(states: list[CachedRequestState], num_scheduled: list[int], block_size: int,
                      spec_tokens: dict[str, list[int]] | None = None) -> StepInputs:
    """Flatten the scheduled tokens of ``states`` (already in the backend builder's batch order) into
    the step's inputs; a request in ``spec_tokens`` has its draft tokens after its own."""
    n = len(states)
    query_lens = np.asarray(num_scheduled, dtype=np.int64)
    starts = np.asarray([s.num_computed_tokens for s in states], dtype=np.int64)
    seq_lens = starts + query_lens
    query_start_loc = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    # position of every token: its request's start + its offset inside the request's chunk
    req_of_token = np.repeat(np.arange(n), query_lens)
    positions = starts[req_of_token] + np.arange(query_start_loc[-1]) - query_start_loc[req_of_token]
    spec_tokens = spec_tokens or {}
    input_ids = np.concatenate([np.asarray((s.token_ids[c:] + spec_tokens[s.req_id] if s.req_id in spec_tokens
                                            else s.token_ids[c:c + q]), dtype=np.int64)
                                for s, c, q in zip(states, starts.tolist(), query_lens.tolist())])
    max_blocks = max(len(s.block_ids) for s in states)
    block_tables = np.zeros((n, max_blocks), dtype=np.int64)
    for row, s in enumerate(states):
        block_tables[row, : len(s.block_ids)] = s.block_ids
    slot_mapping = block_tables[req_of_token, positions // block_size] * block_size + positions % block_size
    sample_rows = [i for i, s in enumerate(states) if seq_lens[i] >= len(s.token_ids)]
    return StepInputs(
        req_ids=[s.req_id for s in states],
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_tables=torch.from_numpy(block_tables.astype(np.int32)),
        slot_mapping=torch.from_numpy(slot_mapping),
        block_size=block_size,
        sample_rows=sample_rows,
        logits_indices=torch.from_numpy(query_start_loc[1:][sample_rows] - 1),
    )


def embeds_tensor(embeds: PromptEmbeds) -> torch.Tensor:
    """A prompt's embeddings as a (num_tokens, hidden) CPU tensor of their own dtype (a copy of the bytes)."""
    flat = torch.frombuffer(bytearray(embeds.data), dtype=getattr(torch, embeds.dtype))
    return flat.view(embeds.num_tokens, embeds.hidden_size)  # (num_tokens, hidden)


def gather_prompt_embeds(states: list[CachedRequestState], num_scheduled: list[int],
                         query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(flat rows, their embeddings (rows, hidden)) of the step's positions that are a prompt given as embeddings
    (``states`` in batch order, ``num_scheduled`` their tokens this step); None when the step has none."""
    if all(s.prompt_embeds is None for s in states):  # (the common step: no list made of query_start_loc)
        return None
    starts = query_start_loc.tolist()
    rows, values = [], []
    for i, (s, q) in enumerate(zip(states, num_scheduled)):
        if s.prompt_embeds is None:
            continue
        first, last = s.num_computed_tokens, min(s.num_computed_tokens + q, s.num_prompt_tokens)
        if first < last:
            rows.append(torch.arange(starts[i], starts[i] + last - first))
            values.append(s.prompt_embeds[first:last])  # (last - first, hidden)
    if not rows:
        return None
    return torch.cat(rows), torch.cat(values)


def build_sampling_metadata(states: list[CachedRequestState], default_generator: torch.Generator,
                            eos_token_ids: tuple[int, ...], device: torch.device | None = None,
                            on_fail: Callable[[str, str, Exception], None] | None = None) -> SamplingMetadata:
    """Sampling settings of the rows that sample (``states`` in row order), as tensors on ``device``
    (the logits'). A row whose own processors fail is reported to ``on_fail(req_id, stage, error)`` (raised
    without one)."""
    params = [s.sampling_params for s in states]
    device = device or torch.device("cpu")
    greedy = [p.greedy for p in params]
    md = SamplingMetadata(
        temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32,
                                 device=device),
        greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
        all_greedy=all(greedy),
        any_greedy=any(greedy),
        any_temperature=any(p.temperature != 1.0 for p, g in zip(params, greedy) if not g),
        default_generator=default_generator,
    )
    if not md.all_greedy:
        if any(p.top_k > 0 for p in params):
            md.top_k = torch.tensor([p.top_k if p.top_k > 0 else 1 << 30 for p in params], dtype=torch.int64,
                                    device=device)
        if any(p.top_p < 1.0 for p in params):
            md.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        if any(p.min_p > 0.0 for p in params):
            md.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        md.generators = {row: s.generator for row, s in enumerate(states) if s.generator is not None}
    if any(p.presence_penalty for p in params):
        md.presence_penalty = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device)
    if any(p.frequency_penalty for p in params):
        md.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device)
    if any(p.repetition_penalty != 1.0 for p in params):
        md.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)
        md.prompt_token_ids = [s.token_ids[: s.num_prompt_tokens] for s in states]
    if md.presence_penalty is not None or md.frequency_penalty is not None or md.repetition_penalty is not None:
        md.output_token_ids = [s.output_token_ids for s in states]
    for row, s in enumerate(states):
        try:
            _row_logits_processors(md, row, s, eos_token_ids, device)
        except Exception as e:  # this request's own lists: it fails alone, its row samples unprocessed
            if on_fail is None:
                raise
            on_fail(s.req_id, "applying the request's logits processors", e)
    if any(p.logprobs is not None for p in params):
        md.max_num_logprobs = max((p.logprobs or 0 for p in params if p.logprob_token_ids is None), default=0)
        md.wants_logprobs = [p.logprobs is not None for p in params]
        md.num_logprobs = [(p.logprobs or 0) if p.logprob_token_ids is None else 0 for p in params]
        md.logprob_token_ids = {row: p.logprob_token_ids for row, p in enumerate(params)
                                if p.logprob_token_ids is not None}
    return md


def _row_logits_processors(md: SamplingMetadata, row: int, s: CachedRequestState, eos_token_ids: tuple[int, ...],
                           device: torch.device) -> None:
    """One row's blocked tokens (min_tokens, bad words), logit bias and allowed tokens into ``md``."""
    p = s.sampling_params
    blocked = []
    if len(s.output_token_ids) < p.min_tokens:
        blocked = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
    if p.bad_words_token_ids:
        blocked += _bad_word_tails(p.bad_words_token_ids, s.output_token_ids)
    if blocked:
        md.blocked_token_ids[row] = blocked
    if p.logit_bias:
        md.logit_bias[row] = (torch.tensor(list(p.logit_bias), dtype=torch.int64, device=device),
                              torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=device))
    if p.allowed_token_ids:
        md.allowed_token_ids[row] = torch.tensor(p.allowed_token_ids, dtype=torch.int64, device=device)
    if p.thinking_token_budget is not None:
        _force_reasoning_end(md, row, s, device)


def _force_reasoning_end(md: SamplingMetadata, row: int, s: CachedRequestState, device: torch.device) -> None:
    """A spent thinking_token_budget: the reasoning's end marker (its next token) is the only one the row may
    sample."""
    p = s.sampling_params
    forced = thinking_budget_forced_token(s.token_ids, p.reasoning_start_token_ids, p.reasoning_end_token_ids,
                                          p.thinking_token_budget, p.reasoning_forced_end_token_ids)
    if forced is not None:
        md.allowed_token_ids[row] = torch.tensor([forced], dtype=torch.int64, device=device)
        md.blocked_token_ids.pop(row, None)


def _bad_word_tails(words: list[list[int]], output: list[int]) -> list[int]:
    """The last token of every bad word whose other tokens are the end of ``output`` (a one-token
    word is always banned)."""
    return [w[-1] for w in words if len(w) == 1 or (len(output) >= len(w) - 1 and output[len(output) - len(w) + 1:]
                                                     == w[:-1])]
