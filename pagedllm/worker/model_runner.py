"""Executes one scheduled step of a generating model, in phases: the requests' states and block moves, the flat
inputs prepared, the forward pass, then sampling (and the next drafts proposed). A pooling model's runner and an
encoder model's are subclasses (worker/pooling_runner.py) that end the step with the pooler instead.

With speculative decoding a request's scheduled tokens end in draft tokens: its last 1 + d rows are all
scored, row j as if drafts[:j] were its output (penalties, min_tokens, bad words, the grammar), and each row
draws a token exactly as a step without drafts would. The drafts are kept up to the first row whose token
differs, and that row's token follows them: every output token is drawn from the model's own distribution
given the tokens before it, so greedy output is unchanged and sampled output keeps its distribution. This is
rejection sampling for a deterministic proposer (accept draft x with probability p(x), else draw from p with
x removed), and a seeded request draws one number per output token from its generator in the same order, so
its tokens are those it gets without speculation.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm import platform
from pagedllm.attention.base import AttentionBackend, StepInputs
from pagedllm.attention.context import forward_context
from pagedllm.attention.layer import Attention
from pagedllm.core.scheduler_output import ForkedRequestData, NewRequestData, SchedulerOutput
from pagedllm.layers.sampler import Sampler, gather_token_logprobs
from pagedllm.lora.manager import LoRAManager
from pagedllm.outputs import ModelRunnerOutput, TokenLogprobs
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.speculator import Speculator
from pagedllm.worker.cuda_graph import DecodeGraphs, Graph
from pagedllm.worker.input_batch import (
    CachedRequestState,
    StepFailures,
    build_sampling_metadata,
    build_step_inputs,
    embeds_tensor,
    gather_prompt_embeds,
)
from pagedllm.worker.structured_output import GrammarCompiler, apply_draft_masks, apply_masks
from pagedllm.worker.watermark import GumbelWatermark

#: Prompt rows scored at once for prompt_logprobs: 256 x vocab float32 logits and their log-softmax (2 x 50 MB at
#: 49,152), where a whole 2,048-token chunk at once took 2 x 0.4 GB more of the core at each step.
PROMPT_LOGPROBS_ROWS = 256


def _copy_blocks(src: list[torch.Tensor], dst: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
    """For every layer, blocks ``pairs[i][0]`` of ``src`` -> ``pairs[i][1]`` of ``dst`` (K and V)."""
    if not pairs:
        return
    from_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=src[0].device)
    to_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dst[0].device)
    for s, d in zip(src, dst):  # (2, num_blocks, ...) each: a block is a whole run of dim 1, scales included
        d.index_copy_(1, to_ids, s.index_select(1, from_ids).to(d.device, non_blocking=True))


@dataclasses.dataclass
class _StepBatch:
    """A step's prepared inputs: the scheduled requests in the backend's order, their token counts, the flat
    inputs, whether LoRA adapters run in it, and the rows of prompts given as embeddings (rows, values)."""

    states: list[CachedRequestState]
    counts: list[int]
    inputs: StepInputs
    adapters: bool
    embeds: tuple[torch.Tensor, torch.Tensor] | None


class ModelRunner:
    """Owns the model, its KV cache tensors and the per-request states of one worker; runs a generating model's
    steps (``execute_model``; ``_run`` is the phase subclasses replace)."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, block_size: int, seed: int,
                 eos_token_ids: tuple[int, ...], device: torch.device | None = None,
                 grammars: Callable[[], GrammarCompiler] | None = None, lora: LoRAManager | None = None,
                 speculator: Speculator | None = None, watermark: GumbelWatermark | None = None) -> None:
        self.model = model
        self.watermark = watermark
        """With watermark_config: the rows it marks take keyed Gumbel-max tokens (worker/watermark.py)."""
        self.speculator = speculator
        """With speculative_config: drafts for the requests that sampled, verified in the next step."""
        self.lora = lora
        """With enable_lora: the adapters' slots; each step tells it which rows run which adapter."""
        self.grammars = grammars
        """The structured-output compiler (made on the first constrained request)."""
        self.device = device or torch.device("cpu")
        self.backend = backend
        self.builder = backend.make_builder()
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler(self.device)  # its kernels chosen for the device, once
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.host_kv_caches: list[torch.Tensor] = []
        self.graphs: DecodeGraphs | None = None
        """Captured decode graphs (capture_model), or None: every step eager."""

    def initialize_kv_cache(self, num_blocks: int, dtype: torch.dtype, num_host_blocks: int = 0) -> None:
        """Allocate one (2, num_blocks, kv_heads, block_size, head_dim) tensor of ``dtype`` per layer (int8:
        (2, num_blocks, kv_heads, block_size * (head_dim + 2)), see attention/kv_quant.py) and bind it.

        With ``num_host_blocks``, a host-memory twin of each for swapped-out blocks (on a GPU it
        would be pinned CPU memory; here both pools are host memory, the code path is the same).
        """
        layers = self._attention_layers()
        self.kv_caches, self.host_kv_caches = [], []
        pinned = platform.is_cuda(self.device)  # swap copies from pinned host memory run asynchronously
        for layer in layers:
            shape = self.backend.kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim,
                                                dtype)
            # zeros, not empty: masked padding keys must not hold NaN bit patterns (0 * NaN = NaN)
            layer.kv_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            self.kv_caches.append(layer.kv_cache)
            if num_host_blocks:
                self.host_kv_caches.append(torch.zeros((shape[0], num_host_blocks, *shape[2:]), dtype=dtype,
                                                       pin_memory=pinned))
        for module in self._with_caches():  # (what kept the old pools' addresses lets them go)
            module.caches_bound()

    def _with_caches(self) -> list[nn.Module]:
        """The modules that hold the KV pools' addresses (models/llama.py's compiled stack), told when they change."""
        models = [self.model, *self.speculator.models()] if self.speculator is not None else [self.model]
        return [m for model in models for m in model.modules() if callable(getattr(m, "caches_bound", None))]

    def _attention_layers(self) -> list[Attention]:
        """Every attention layer with a KV tensor: the model's, then a draft model's (same block ids)."""
        models = [self.model, *self.speculator.models()] if self.speculator is not None else [self.model]
        return [m for model in models for m in model.modules() if isinstance(m, Attention)]

    def profile_run(self, num_tokens: int, dtype: torch.dtype) -> None:
        """One prompt of ``num_tokens`` tokens through the model and the sampler, on a KV pool just
        big enough, then everything of it dropped: the peak memory of a full step (GPU sizing)."""
        blocks = -(-num_tokens // self.block_size)
        self.initialize_kv_cache(blocks + 1, dtype)
        req = NewRequestData(req_id="profile", prompt_token_ids=[0] * num_tokens, sampling_params=SamplingParams(),
                             block_ids=list(range(1, blocks + 1)), num_computed_tokens=0)
        self.execute_model(SchedulerOutput(scheduled_new_reqs=[req], num_scheduled_tokens={"profile": num_tokens}))
        self.execute_model(SchedulerOutput(finished_req_ids={"profile"}))  # the speculator forgets it too
        for layer in self._attention_layers():
            layer.kv_cache = None
        self.kv_caches = []

    def capture_model(self, sizes: tuple[int, ...], max_model_len: int,
                      make_graph: Callable[[], Graph] | None = None) -> None:
        """Capture the decode forward pass at each batch size of ``sizes`` (after initialize_kv_cache:
        the graphs hold the KV tensors' addresses). ``make_graph``: a stand-in for CUDA graphs (tests)."""
        self.graphs = DecodeGraphs(self.model, self.backend, self.builder, sizes, self.block_size, max_model_len,
                                   self.device, make_graph)
        self.graphs.capture()

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One step: the requests' states and blocks brought up to date, then (unless nothing is scheduled) the
        step run. A request whose own preparation or sampling fails is in the returned ``failed``; the step goes
        on."""
        failures = StepFailures()
        self._update_states(out, failures)
        # order matters: swapped-out blocks may be handed to other requests in this very step
        _copy_blocks(self.kv_caches, self.host_kv_caches, out.blocks_to_swap_out)
        _copy_blocks(self.kv_caches, self.kv_caches, out.blocks_to_copy)
        _copy_blocks(self.host_kv_caches, self.kv_caches, out.blocks_to_swap_in)
        result = ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[]) if out.is_empty else \
            self._run(out, failures)
        result.failed = dict(failures)
        return result

    def _run(self, out: SchedulerOutput, failures: StepFailures) -> ModelRunnerOutput:
        """A generating step: inputs prepared, the forward pass, the prompt rows' logprobs, then a sample per request
        that needs one (and the drafts proposed after it)."""
        batch = self._prepare_inputs(out)
        return self._score_and_sample(out, batch, self._forward(batch), failures)

    def _score_and_sample(self, out: SchedulerOutput, batch: _StepBatch, hidden: torch.Tensor,
                          failures: StepFailures) -> ModelRunnerOutput:
        """After the forward pass: the prompt rows' logprobs, then the samples (``_sample_step``)."""
        states = batch.states
        scored = ({}, {}) if not any(s.sampling_params.scores_prompt for s in states) else \
            self._prompt_logprobs(states, batch.counts, batch.inputs.query_start_loc, hidden)
        count_computed(batch)
        if not batch.inputs.sample_rows:
            result = ModelRunnerOutput(req_ids=batch.inputs.req_ids, sampled_token_ids=[[] for _ in states],
                                       logprobs=[None] * len(states))
        else:
            result = self._sample_step(out, batch, hidden, failures)
        result.prompt_logprobs, result.prompt_id_scores = scored
        return result

    def _prepare_inputs(self, out: SchedulerOutput) -> _StepBatch:
        """The scheduled requests in the order the backend wants, their flat inputs, the rows of each LoRA
        adapter and the rows of prompts given as embeddings."""
        order = self.builder.order(out.num_scheduled_tokens)
        states = [self.requests[r] for r in order]
        counts = [out.num_scheduled_tokens[r] for r in order]
        inputs = build_step_inputs(states, counts, self.block_size, out.scheduled_spec_decode_tokens)
        # the rows of each LoRA adapter (graphs are captured without adapters: such steps run eagerly)
        adapters = self.lora is not None and self.lora.prepare([s.lora_request for s in states],
                                                               inputs.query_start_loc.tolist())
        embeds = gather_prompt_embeds(states, counts, inputs.query_start_loc)
        return _StepBatch(states=states, counts=counts, inputs=inputs, adapters=bool(adapters), embeds=embeds)

    def _forward(self, batch: _StepBatch) -> torch.Tensor:
        """The model over the step's tokens: one graph replay for a decode step within the captured sizes, else
        eager (hidden states: (tokens, hidden))."""
        inputs, embeds = batch.inputs, batch.embeds
        graph_size = self.graphs.size_for(inputs) if self.graphs is not None and not batch.adapters \
            and embeds is None else None
        if graph_size is not None:
            return self.graphs.run(inputs, graph_size)
        input_ids = inputs.input_ids.to(self.device, non_blocking=True)
        inputs_embeds = None
        if embeds is not None:  # the ids' embeddings, with a prompt's own rows in place of its placeholders'
            inputs_embeds = self.model.embed_input_ids(input_ids)  # (tokens, hidden)
            rows, values = embeds
            inputs_embeds[rows.to(self.device)] = values.to(self.device, inputs_embeds.dtype)
        with forward_context(self.backend, self.builder.build(inputs)):
            positions = inputs.positions.to(self.device, non_blocking=True)
            if inputs_embeds is None:
                return self.model(input_ids, positions)
            return self.model(input_ids, positions, inputs_embeds=inputs_embeds)

    def _sample_step(self, out: SchedulerOutput, batch: _StepBatch, hidden: torch.Tensor,
                     failures: StepFailures) -> ModelRunnerOutput:
        """A token (or a run of accepted drafts and one more) for each row that samples, forked samples drawing
        from their parent's row; the grammars advanced; the next drafts proposed."""
        samplers, rows = self._samplers(out, batch)
        spec = out.scheduled_spec_decode_tokens
        if spec:
            tokens, logprobs = self._sample_with_drafts(samplers, rows, [spec.get(s.req_id, []) for s in samplers],
                                                        hidden, batch.inputs.logits_indices, failures)
        else:
            tokens, logprobs = self._sample(samplers, rows, hidden, batch.inputs.logits_indices, failures)
        for state, new in zip(samplers, tokens):
            take_tokens(state, new)
            if state.matcher is not None:
                _advance_grammar(state, new, failures)
        drafts = {} if self.speculator is None else self.speculator.propose(samplers)
        return ModelRunnerOutput(req_ids=[s.req_id for s in samplers], sampled_token_ids=tokens, logprobs=logprobs,
                                 spec_token_ids=drafts)

    def _samplers(self, out: SchedulerOutput, batch: _StepBatch) -> tuple[list[CachedRequestState], list[int]]:
        """The requests that sample this step and the logits row each reads: forked samples draw from their
        parent's row (the prompt was computed once)."""
        samplers = [batch.states[i] for i in batch.inputs.sample_rows]
        row_of = {s.req_id: row for row, s in enumerate(samplers)}
        rows = list(range(len(samplers)))
        for fork in out.forked_reqs:
            samplers.append(self.requests[fork.req_id])
            rows.append(row_of[fork.parent_id])
        return samplers, rows

    def _sample(self, samplers: list[CachedRequestState], rows: list[int], hidden: torch.Tensor,
                logits_indices: torch.Tensor, failures: StepFailures
                ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """One token per sampler from its logits row (``rows[i]``: which sample row it reads)."""
        # only rows that sample; in the model's dtype: the sampler makes a float32 copy only if it must
        logits = self.model.compute_logits(hidden[logits_indices.to(self.device)], keep_dtype=True)
        if len(rows) > logits.shape[0]:
            logits = logits[torch.tensor(rows, device=self.device)]
        matchers = {row: s.matcher for row, s in enumerate(samplers) if s.matcher is not None}
        if matchers:  # only the constrained rows pay: one bitmask for them all
            logits = apply_masks(logits, matchers)
        md = build_sampling_metadata(samplers, self.generator, self.eos_token_ids, self.device, failures.add)
        if self.watermark is not None and not md.all_greedy:
            md.watermark_noise = self.watermark.noise(samplers, md.greedy.tolist(), logits.shape[-1], logits.device)
        result = self.sampler(logits, md)
        sampled = result.sampled_token_ids.tolist()  # the step's one wait for the device
        return [[t] for t in sampled], [None if lp is None else [lp] for lp in result.logprobs]

    def _sample_with_drafts(self, samplers: list[CachedRequestState], rows: list[int], drafts: list[list[int]],
                            hidden: torch.Tensor, logits_indices: torch.Tensor, failures: StepFailures
                            ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """Verify each sampler's drafts (module docstring): its 1 + d last rows drawn as if the drafts before
        each were its output; the drafts kept up to the first row that draws another token, plus that token."""
        last = logits_indices.tolist()
        index, first, views = [], [], []
        for state, row, d in zip(samplers, rows, drafts):
            first.append(len(index))
            index.extend(range(last[row] - len(d), last[row] + 1))  # a request's rows end at its last token
            views += [state] + [dataclasses.replace(state, token_ids=state.token_ids + d[:j])
                                for j in range(1, len(d) + 1)]
        logits = self.model.compute_logits(hidden[torch.tensor(index, device=self.device)], keep_dtype=True)
        allowed = [len(d) for d in drafts]
        constrained = [i for i, s in enumerate(samplers) if s.matcher is not None]
        if constrained:  # each row masked as the grammar stands after the drafts before it
            logits, fed = apply_draft_masks(logits, [(first[i], samplers[i].matcher, drafts[i],
                                                      samplers[i].output_token_ids) for i in constrained])
            for i, n in zip(constrained, fed):
                allowed[i] = n
        # a seeded sampling request draws one number per row; it must end up having drawn one per output token
        seeded = {i: s.generator.get_state() for i, (s, d) in enumerate(zip(samplers, drafts))
                  if d and s.generator is not None and not s.sampling_params.greedy}
        md = build_sampling_metadata(views, self.generator, self.eos_token_ids, self.device, failures.add)
        result = self.sampler(logits, md)
        sampled = result.sampled_token_ids.tolist()  # the step's one wait for the device
        tokens, logprobs = [], []
        for i, (state, d) in enumerate(zip(samplers, drafts)):
            start, kept = first[i], 0
            while kept < allowed[i] and sampled[start + kept] == d[kept]:
                kept += 1
            tokens.append(sampled[start:start + kept + 1])
            lps = result.logprobs[start:start + kept + 1]
            logprobs.append(None if lps[0] is None else lps)
            if i in seeded:
                state.generator.set_state(seeded[i])
                for _ in range(kept + 1):
                    torch.rand(1, generator=state.generator, device=self.device)
            if d and self.speculator is not None:
                self.speculator.record(state.req_id, len(d), kept)
        return tokens, logprobs

    def _prompt_logprobs(self, states: list[CachedRequestState], counts: list[int], starts: torch.Tensor,
                         hidden: torch.Tensor) -> tuple[dict, dict]:
        """For requests that score their prompt, the rows this step predicts (row p scores prompt token p + 1; from
        prompt_logprob_start on): ({request: (first token scored, prompt_logprobs' entries)}, {request: (first
        scored row, its prompt_logprob_token_ids' scores)})."""
        found: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        id_found: dict[str, tuple[int, list[list[float]]]] = {}
        for i, (state, n) in enumerate(zip(states, counts)):
            params = state.sampling_params
            chunk = state.num_computed_tokens  # this chunk's first position (not advanced yet)
            start = params.prompt_logprob_start or 0
            first, last = max(chunk, start), min(chunk + n, state.num_prompt_tokens - 1)
            if not params.scores_prompt or last <= first:
                continue
            entries, scores = self._score_rows(state, hidden[int(starts[i]) + first - chunk:], first, last, start)
            if params.prompt_logprobs is not None:
                found[state.req_id] = (first + 1, entries)
            if params.prompt_logprob_token_ids is not None:
                id_found[state.req_id] = (first - start, scores)
        return found, id_found

    def _score_rows(self, state: CachedRequestState, hidden: torch.Tensor, first: int, last: int, start: int
                    ) -> tuple[list[TokenLogprobs], list[list[float]]]:
        """Prompt rows ``first`` .. ``last`` - 1 of one request (``hidden`` starts at row ``first``): its
        prompt_logprobs entries and its prompt_logprob_token_ids scores (rows counted from ``start``)."""
        params, entries, scores = state.sampling_params, [], []
        for lo in range(first, last, PROMPT_LOGPROBS_ROWS):  # a slice of rows at a time: see the constant
            hi = min(lo + PROMPT_LOGPROBS_ROWS, last)
            logprobs = self.model.compute_logits(hidden[lo - first:hi - first]).log_softmax(-1)  # (rows, vocab)
            if params.prompt_logprobs is not None:
                targets = torch.tensor(state.token_ids[lo + 1:hi + 1], dtype=torch.long, device=logprobs.device)
                entries += gather_token_logprobs(logprobs, targets, params.prompt_logprobs)
            if params.prompt_logprob_token_ids is not None:
                ids = torch.tensor(params.prompt_logprob_token_ids[lo - start:hi - start], device=logprobs.device)
                picked = logprobs.float().gather(1, ids.clamp_min(0))  # (rows, ids); -1 pads score -inf
                scores += picked.masked_fill(ids < 0, float("-inf")).tolist()
        return entries, scores

    def _update_states(self, out: SchedulerOutput, failures: StepFailures) -> None:
        """The requests finished, joining, resumed or forked in this step, as the scheduler tells (a new request
        whose sampling state cannot be made is in ``failures``)."""
        for req_id in out.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None and self.speculator is not None:
                self.speculator.finish(req_id, state.token_ids, state.num_prompt_tokens)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = self._new_state(new, failures)
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            if cached.replace_table:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            if cached.replace_table and self.speculator is not None:  # a draft's K/V past there may be gone
                self.speculator.rewind(cached.req_id, cached.num_computed_tokens)
        for fork in out.forked_reqs:
            self.requests[fork.req_id] = self._forked_state(fork, failures)

    def _new_state(self, new: NewRequestData, failures: StepFailures) -> CachedRequestState:
        """The state of a request joining the batch (new, or resumed after preemption with its output so far)."""
        prompt = list(new.prompt_token_ids)
        generator, matcher = self._sampling_state(new.req_id, new.sampling_params, list(new.output_token_ids),
                                                  failures)
        return CachedRequestState(
            req_id=new.req_id, token_ids=prompt + list(new.output_token_ids), num_prompt_tokens=len(prompt),
            sampling_params=new.sampling_params, generator=generator, block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens, matcher=matcher, lora_request=new.lora_request,
            pooling_params=new.pooling_params, token_type_ids=new.token_type_ids,
            prompt_embeds=None if new.prompt_embeds is None else embeds_tensor(new.prompt_embeds))

    def _forked_state(self, fork: ForkedRequestData, failures: StepFailures) -> CachedRequestState:
        """The state of a sample forked from its parent after the prompt (its own params, seed and blocks)."""
        parent = self.requests[fork.parent_id]
        generator, matcher = self._sampling_state(fork.req_id, fork.sampling_params, parent.output_token_ids,
                                                  failures)
        return CachedRequestState(
            req_id=fork.req_id, token_ids=list(parent.token_ids), num_prompt_tokens=parent.num_prompt_tokens,
            sampling_params=fork.sampling_params, generator=generator, block_ids=list(fork.block_ids),
            num_computed_tokens=fork.num_computed_tokens, matcher=matcher, lora_request=parent.lora_request,
            prompt_embeds=parent.prompt_embeds)

    def _sampling_state(self, req_id: str, params: SamplingParams, accepted: list[int],
                        failures: StepFailures) -> tuple[Any, Any]:
        """(generator, grammar matcher) of a request joining the batch; if making them fails, the request is
        reported failed (it still runs this step: the batch stays as scheduled) and neither is used."""
        try:
            return _generator(params, self.device), self._matcher(params, accepted)
        except Exception as e:  # this request's own input: it fails alone
            failures.add(req_id, "preparing the request's sampling state", e)
            return None, None

    def _matcher(self, params: SamplingParams, accepted: list[int]) -> Any:
        """A constrained request's grammar matcher, fed its output so far (a resumed request's: with
        grammar_after_reasoning, only what follows the reasoning's end in it, or asleep if it has not ended)."""
        if params.structured_outputs is None:
            return None
        assert self.grammars is not None, "the worker gives the runner its grammar compiler"
        ends = None
        if params.grammar_after_reasoning:
            ends = [params.reasoning_end_token_ids or [], params.reasoning_forced_end_token_ids or []]
        return self.grammars().matcher(params.structured_outputs, accepted, ends,
                                       params.reasoning_implicit_end_token_ids or ())


def _generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    return torch.Generator(device).manual_seed(params.seed) if params.seed is not None else None


def take_tokens(state: CachedRequestState, tokens: list[int]) -> None:
    """A request's new tokens appended; every token before the last is computed (rejected drafts are not)."""
    state.token_ids.extend(tokens)
    state.num_computed_tokens = len(state.token_ids) - 1


def count_computed(batch: _StepBatch) -> None:
    """Count the step's tokens as computed for each of its requests."""
    for state, n in zip(batch.states, batch.counts):
        state.num_computed_tokens += n


def _advance_grammar(state: CachedRequestState, tokens: list[int], failures: StepFailures) -> None:
    """Feed the request's new tokens to its grammar (those after its reasoning, with grammar_after_reasoning);
    a failure fails this request alone."""
    try:
        for token in state.matcher.readable(state.output_token_ids, len(tokens)):
            if state.matcher.is_terminated():
                return
            state.matcher.accept_token(token)
    except Exception as e:  # this request's grammar: it fails alone
        state.matcher = None
        failures.add(state.req_id, "advancing the request's grammar", e)
