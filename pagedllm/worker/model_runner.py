"""Executes one scheduled step: state update, flat inputs, forward, logits, sampling."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend, CommonAttentionMetadata
from pagedllm.attention.context import forward_context
from pagedllm.attention.layer import Attention
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.layers.sampler import Sampler
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.worker.input_batch import CachedRequestState, build_sampling_metadata, build_step_inputs


class ModelRunner:
    """Owns the model, its KV cache tensors and the per-request states of one worker."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, block_size: int, seed: int,
                 eos_token_id: int | None) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.sampler = Sampler()
        self.generator = torch.Generator().manual_seed(seed)
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []

    def initialize_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        """Allocate one (2, num_blocks, block_size, kv_heads, head_dim) tensor per layer and bind it."""
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in layers:
            shape = self.backend.kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            # zeros, not empty: masked padding keys must not hold NaN bit patterns (0 * NaN = NaN)
            layer.kv_cache = torch.zeros(shape, dtype=dtype)
            self.kv_caches.append(layer.kv_cache)

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(out)
        if out.is_empty:
            return ModelRunnerOutput([], [], [])
        # decode requests (one query token) first: the attention backend batches them together
        order = sorted(out.num_scheduled_tokens, key=lambda r: out.num_scheduled_tokens[r] != 1)
        states = [self.requests[r] for r in order]
        inputs = build_step_inputs(states, [out.num_scheduled_tokens[r] for r in order], self.block_size)
        metadata = self.backend.build_metadata(CommonAttentionMetadata(
            inputs.query_start_loc, inputs.seq_lens, inputs.block_tables, inputs.slot_mapping,
            inputs.num_decodes, self.block_size))
        with forward_context(self.backend, metadata):
            hidden = self.model(inputs.input_ids, inputs.positions)
        sampled_ids: list[list[int]] = [[] for _ in states]
        logprobs: list = [None] * len(states)
        if inputs.sample_rows:
            sampling_states = [states[i] for i in inputs.sample_rows]
            logits = self.model.compute_logits(hidden[inputs.logits_indices])  # only rows that sample
            md = build_sampling_metadata(sampling_states, self.generator, self.eos_token_id)
            result = self.sampler(logits, md)
            for row, token, lp in zip(inputs.sample_rows, result.sampled_token_ids.tolist(), result.logprobs):
                states[row].token_ids.append(token)
                sampled_ids[row] = [token]
                logprobs[row] = lp
        for state, n in zip(states, (out.num_scheduled_tokens[r] for r in order)):
            state.num_computed_tokens += n
        return ModelRunnerOutput(inputs.req_ids, sampled_ids, logprobs)

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            p = new.sampling_params
            generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids), len(new.prompt_token_ids), p, generator,
                list(new.block_ids), new.num_computed_tokens)
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.resumed:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
