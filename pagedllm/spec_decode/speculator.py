"""When to speculate, and for whom: the proposer of speculative_config behind a per-request and per-step policy.

The worker asks after every step for the drafts of the requests that just sampled. A request speculates
unless it opted out (``SamplingParams.speculate``), the step ran more decoding sequences than
``disable_by_batch_size`` (a larger batch is no longer bound by reading the weights, so the extra tokens a
verification adds cost their full price), or it is backing off: its drafts' acceptance rate (a moving average)
fell below ``min_acceptance_rate``, so it skips proposals for a number of steps that doubles each time it fails
again and halves back when it succeeds.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagedllm.config import SpeculativeConfig

if TYPE_CHECKING:
    from torch import nn

    from pagedllm.worker.input_batch import CachedRequestState

logger = logging.getLogger(__name__)

EMA_WEIGHT = 0.3
"""Weight of the newest step in a request's acceptance rate."""
MIN_BACKOFF, MAX_BACKOFF = 4, 256
"""Steps a failing request skips first, and at most."""


class TokenProposer(Protocol):
    """A proposer that drafts from token ids alone (ngram, suffix)."""

    def propose(self, req_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]: ...

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None: ...


class BatchProposer(Protocol):
    """A proposer that drafts for a whole batch at once (the draft model)."""

    def propose_batch(self, states: list[CachedRequestState], num_tokens: int) -> dict[str, list[int]]: ...

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None: ...


@dataclass
class _Record:
    rate: float = 1.0
    """Moving average of the fraction of drafts accepted."""
    skip: int = 0
    """Steps left without proposals."""
    backoff: int = 0
    """The next back-off length (0: none yet)."""


class Speculator:
    """Drafts for a step's decoding requests, under the policy of the module docstring."""

    def __init__(self, config: SpeculativeConfig, proposer: TokenProposer | BatchProposer) -> None:
        self.config = config
        self.proposer = proposer
        self.records: dict[str, _Record] = {}

    def propose(self, states: list[CachedRequestState]) -> dict[str, list[int]]:
        """Drafts (possibly empty) for ``states``, the requests that sampled this step."""
        limit = self.config.disable_by_batch_size
        if not states or (limit is not None and len(states) > limit):
            return {}
        eligible = []
        for state in states:
            record = self.records.setdefault(state.req_id, _Record())
            if not state.sampling_params.speculate:
                continue
            if record.skip > 0:
                record.skip -= 1
                continue
            eligible.append(state)
        k = self.config.num_speculative_tokens
        # drafts only ever save time: a proposer that fails costs its requests their drafts, never their tokens
        if hasattr(self.proposer, "propose_batch"):
            try:
                return self.proposer.propose_batch(eligible, k) if eligible else {}
            except Exception as e:
                logger.warning("the draft model failed to propose (no drafts this step): %r", e, exc_info=True)
                return {}
        drafts = {}
        for state in eligible:
            try:
                tokens = self.proposer.propose(state.req_id, state.token_ids, k)
            except Exception as e:
                logger.warning("request %s: proposing drafts failed (none this step): %r", state.req_id, e,
                               exc_info=True)
                continue
            if tokens:
                drafts[state.req_id] = tokens
        return drafts

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome: updates the request's rate and back-off."""
        floor = self.config.min_acceptance_rate
        record = self.records.setdefault(req_id, _Record())
        record.rate = (1 - EMA_WEIGHT) * record.rate + EMA_WEIGHT * num_accepted / num_drafts
        if floor <= 0:
            return
        if record.rate < floor:
            record.backoff = min(MAX_BACKOFF, 2 * record.backoff) if record.backoff else MIN_BACKOFF
            record.skip = record.backoff
            record.rate = floor  # a fresh start after the back-off: one good step lifts it above the floor
        elif num_accepted:
            record.backoff //= 2

    def models(self) -> list[nn.Module]:
        """The proposer's model (a draft model's attention layers get KV tensors), if it has one."""
        model = getattr(self.proposer, "model", None)
        return [] if model is None else [model]

    def rewind(self, req_id: str, num_tokens: int) -> None:
        """The request's K/V past ``num_tokens`` may be gone (its block table was replaced)."""
        if hasattr(self.proposer, "rewind"):
            self.proposer.rewind(req_id, num_tokens)

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request ended: the proposer may keep its response (suffix decoding); its record goes."""
        self.records.pop(req_id, None)
        self.proposer.finish(req_id, token_ids, num_prompt_tokens)


def make_speculator(config: SpeculativeConfig | None) -> Speculator | None:
    """The speculator of ``config`` with a token-lookup proposer (the draft model's is made by the worker, which
    holds the weights); None when speculation is off."""
    if config is None or config.uses_draft_model:
        return None
    if config.method == "ngram":
        from pagedllm.spec_decode.ngram import NgramProposer
        return Speculator(config, NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max))
    from pagedllm.spec_decode.suffix import SuffixProposer  # the one method left (SPEC_METHODS)
    return Speculator(config, SuffixProposer(
        max_tree_depth=config.suffix_decoding_max_tree_depth,
        max_cached_requests=config.suffix_decoding_max_cached_requests,
        max_spec_factor=config.suffix_decoding_max_spec_factor,
        min_token_prob=config.suffix_decoding_min_token_prob))
