"""The model runners of pooling models: each request's hidden states become its vector (nothing is sampled).

``PoolingModelRunner`` runs a decoder model as an embedder or classifier over the same paged KV cache and
flat inputs as generation (each request's whole input is in one step: the scheduler never chunks a pooling
request); ``EncoderModelRunner`` runs an encoder-only model (BERT, ModernBERT), whose inputs attend both ways
and cache nothing.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.attention.base import AttentionBackend
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.layers.pooler import Pooler
from pagedllm.lora.manager import LoRAManager
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.worker.input_batch import CachedRequestState, StepFailures
from pagedllm.worker.model_runner import ModelRunner, count_computed


class PoolingModelRunner(ModelRunner):
    """A decoder model's steps ended by its pooler: inputs, the forward pass, then each request's vector."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, block_size: int, seed: int,
                 eos_token_ids: tuple[int, ...], device: torch.device | None, pooler: Pooler,
                 lora: LoRAManager | None = None) -> None:
        super().__init__(model, backend, block_size, seed, eos_token_ids, device, lora=lora)
        self.pooler = pooler
        """Pools every request's hidden states into its vector (layers/pooler.py)."""

    def _run(self, out: SchedulerOutput, failures: StepFailures) -> ModelRunnerOutput:
        batch = self._prepare_inputs(out)
        hidden = self._forward(batch)
        count_computed(batch)
        return self._pooled(batch.states, batch.counts, hidden, failures)

    def _pooled(self, states: list[CachedRequestState], counts: list[int], hidden: torch.Tensor,
                failures: StepFailures) -> ModelRunnerOutput:
        """The step's output: each request's vector (a failure fails the step's requests alone)."""
        params = [s.pooling_params for s in states]
        assert all(p is not None for p in params), "a pooling model runs pooling requests only"
        try:
            vectors = self.pooler(hidden, counts, params)
        except Exception as e:  # e.g. a head that cannot take this input: these requests fail, the engine goes on
            for state in states:
                failures.add(state.req_id, "pooling", e)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])
        return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[],
                                 pooler_output={s.req_id: v for s, v in zip(states, vectors)})


class EncoderModelRunner(PoolingModelRunner):
    """An encoder-only model's steps: each scheduled request's whole input, attending both ways, then pooled."""

    def _run(self, out: SchedulerOutput, failures: StepFailures) -> ModelRunnerOutput:
        states = [self.requests[r] for r in out.num_scheduled_tokens]
        lens = [len(s.token_ids) for s in states]
        assert lens == [out.num_scheduled_tokens[s.req_id] for s in states], "encoder inputs are never chunked"
        # one array per request, joined once: no Python loop over the step's tokens
        input_ids = torch.from_numpy(np.concatenate([np.asarray(s.token_ids, dtype=np.int64) for s in states]))
        positions = torch.from_numpy(np.concatenate([np.arange(n, dtype=np.int64) for n in lens]))
        types = None if all(s.token_type_ids is None for s in states) else torch.from_numpy(np.concatenate(
            [np.asarray(s.token_type_ids, dtype=np.int64) if s.token_type_ids is not None
             else np.zeros(n, dtype=np.int64) for s, n in zip(states, lens)]))
        hidden = self.model(input_ids.to(self.device), positions.to(self.device), lens,
                            None if types is None else types.to(self.device))
        for state, n in zip(states, lens):
            state.num_computed_tokens = n
        return self._pooled(states, lens, hidden, failures)


def runner_for(model: nn.Module, pooler: Pooler | None) -> type[ModelRunner]:
    """The runner class of ``model``: an encoder's, a pooling decoder's, or a generating model's."""
    if getattr(model, "is_encoder_only", False):
        assert pooler is not None, "an encoder-only model runs with a pooler"
        return EncoderModelRunner
    return ModelRunner if pooler is None else PoolingModelRunner
