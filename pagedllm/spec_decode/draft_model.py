"""The draft-model proposer: a smaller model with the target's vocabulary drafts tokens greedily.

Its K/V live in its own tensors indexed by the target's block tables (one block id holds a request's
target and draft K/V for the same positions; the KV pool's bytes per block count both), so it needs no
allocator of its own: the scheduler keeps ``num_speculative_tokens`` slots past each decoding request's
scheduled tokens for the drafts it writes before they are verified.

After each step the draft catches up on the request's tokens it has not computed (a new request's whole
prompt, or the last accepted tokens and the new one) in one flat forward, then runs one decode forward per
further draft. Drafts are the draft's argmax: a deterministic proposal, which the target verifies exactly
(worker/model_runner.py). Draft K/V of rejected positions are simply not counted: the next catch-up rewrites
them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend
from pagedllm.attention.context import forward_context
from pagedllm.worker.input_batch import CachedRequestState, build_step_inputs


class DraftModelProposer:
    """Greedy drafts from ``model`` (loaded and bound to its KV tensors by the worker)."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, block_size: int, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.builder = backend.make_builder()
        self.block_size = block_size
        self.device = device
        self.computed: dict[str, int] = {}
        """Request -> positions whose draft K/V are valid (a prefix of its accepted tokens)."""

    def rewind(self, req_id: str, num_tokens: int) -> None:
        """Only the first ``num_tokens`` positions of the request still hold its draft K/V (its table was
        replaced: resumed, swapped in or copied on write; or tokens past there were rejected)."""
        if req_id in self.computed:
            self.computed[req_id] = min(self.computed[req_id], num_tokens)

    @torch.inference_mode()
    def propose_batch(self, states: list[CachedRequestState], num_tokens: int) -> dict[str, list[int]]:
        """Up to ``num_tokens`` greedy drafts for each state (fewer where its block table ends sooner)."""
        # the slots a request's drafts may use: its table's; the last draft needs none (it is not forwarded)
        room = {s.req_id: min(num_tokens, len(s.block_ids) * self.block_size - len(s.token_ids) + 1) for s in states}
        live = [s for s in states if room[s.req_id] > 0]
        if not live:
            return {}
        # catch up: every token the draft lacks, one flat forward (the target's accepted tokens are computed)
        starts = [min(self.computed.get(s.req_id, 0), s.num_computed_tokens) for s in live]
        views = [dataclasses.replace(s, num_computed_tokens=c) for s, c in zip(live, starts)]
        drafts = {s.req_id: [t] for s, t in zip(live, self._forward(views, [len(s.token_ids) - c for s, c in
                                                                        zip(live, starts)]))}
        for s in live:
            self.computed[s.req_id] = len(s.token_ids)
        # one decode forward per further draft, for the requests that still have room
        for step in range(1, num_tokens):
            going = [s for s in live if room[s.req_id] > step]
            if not going:
                break
            views = [dataclasses.replace(s, token_ids=s.token_ids + drafts[s.req_id],
                                         num_computed_tokens=len(s.token_ids) + step - 1) for s in going]
            for s, t in zip(going, self._forward(views, [1] * len(views))):
                drafts[s.req_id].append(t)
                self.computed[s.req_id] = len(s.token_ids) + step
        return drafts

    def _forward(self, views: list[CachedRequestState], counts: list[int]) -> list[int]:
        """The draft's argmax after each view's ``counts`` tokens from its num_computed_tokens on."""
        order = self.builder.order({v.req_id: n for v, n in zip(views, counts)})
        by_id = {v.req_id: (v, n) for v, n in zip(views, counts)}
        ordered = [by_id[r] for r in order]
        inputs = build_step_inputs([v for v, _ in ordered], [n for _, n in ordered], self.block_size)
        with forward_context(self.backend, self.builder.build(inputs)):
            hidden = self.model(inputs.input_ids.to(self.device, non_blocking=True),
                                inputs.positions.to(self.device, non_blocking=True))
        last = inputs.query_start_loc[1:].long() - 1  # (num_reqs,) each request's last row
        tokens = self.model.compute_logits(hidden[last.to(self.device)]).argmax(dim=-1).tolist()
        found = dict(zip(order, tokens))
        return [found[v.req_id] for v in views]

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request ended: forget it."""
        self.computed.pop(req_id, None)
