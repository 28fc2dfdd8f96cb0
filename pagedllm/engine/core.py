"""The engine core: the scheduler, the executor (the model on its workers), beam search, the KV pool's state and
the LoRA adapters. One ``step()`` is one batch. It takes tokenized requests (engine/messages.py) and answers
token ids: prompts and text are the front end's (engine/llm_engine.py, engine/async_llm.py), which reaches
it through a client (engine/core_client.py); engine/core_loop.py steps it for the server.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import logging
import os
import time
from typing import Any

from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.core.kv_cache_manager import ROUTING_KEY_MASK
from pagedllm.core.kv_map import kv_map
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step_time import cost_weights
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.batch_queue import BatchQueue
from pagedllm.engine.beam_search import BeamSearchManager
from pagedllm.engine.lifecycle import Lifecycle, check_mode
from pagedllm.engine.messages import (
    PROTOCOL_VERSION,
    Abort,
    AddBeamSearch,
    AddRequest,
    CoreReady,
    EngineStats,
    StepOutputs,
)
from pagedllm.engine.request_factory import RequestFactory
from pagedllm.errors import ValidationError
from pagedllm.executor.factory import get_executor_class
from pagedllm.lora_request import LoRARequest
from pagedllm.models.config import ArchConfig
from pagedllm.models.loader import hand_on_tokenizer, load_eos_token_ids, load_tokenizer
from pagedllm.outputs import EngineCoreOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.request import RequestStatus
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.worker.memory_fit import check_fits
from pagedllm.worker.structured_output import compiler_for

logger = logging.getLogger(__name__)


def resolve_pooling_params(params: PoolingParams, model: ModelConfig, hidden_size: int) -> PoolingParams:
    """A pooling request's parameters checked against the model, with its defaults filled in: task "embed" or
    "classify" (what the workers run; "score" is the one the model scores pairs with), normalize and
    use_activation decided."""
    tasks = model.pooling_tasks
    task = params.task or tasks[0]
    if task not in tasks:
        use = {"embed": "/v1/embeddings (LLM.embed)", "classify": "/classify (LLM.classify)"}[tasks[0]]
        raise ValidationError(f"this model does not support the pooling task {task!r} (it supports {list(tasks)}): "
                              f"use {use}", param="task", value=task)
    run = tasks[0]  # a pair is scored by the model's own task: embeddings' cosine, or the cross-encoder's logit
    bad = ValidationError.bad_value
    if run == "embed":
        if params.use_activation is not None:
            raise bad("use_activation", params.use_activation, "null for embeddings (it is for classes and scores)")
        dims, trained = params.dimensions, model.pooler.matryoshka_dimensions
        if dims is not None and dims != hidden_size:
            if trained is None:
                raise ValidationError(f"this model does not support Matryoshka embeddings: dimensions must be "
                                      f"{hidden_size} (its size) or left out, got {dims}", param="dimensions",
                                      value=dims)
            if dims > hidden_size or (trained and dims not in trained):
                raise bad("dimensions", dims, f"one of {list(trained) or f'1 .. {hidden_size}'}")
        normalize = model.pooler.normalize if params.normalize is None else params.normalize
        return dataclasses.replace(params, task=run, normalize=normalize)
    for name in ("dimensions", "normalize"):
        if getattr(params, name) is not None:
            raise bad(name, getattr(params, name), "null for classification and scores (it is for embeddings)")
    return dataclasses.replace(params, task=run, use_activation=params.use_activation is not False)


def _request_factory(config: EngineConfig, arch: ArchConfig, tokenizer: Any, eos: tuple[int, ...]) -> RequestFactory:
    """The core's request factory; its grammar compiler is the worker's own when that runs in this process (one
    grammar cache per process)."""
    grammars = functools.partial(compiler_for, config.model.model, arch.vocab_size, tuple(eos),
                                 config.structured_outputs)
    return RequestFactory(tokenizer, config.model.max_model_len, arch.vocab_size, eos, grammars,
                          max_logprobs=config.model.max_logprobs,
                          embeds_hidden_size=arch.embeds_width if config.model.enable_prompt_embeds else None)


def _scheduler(config: EngineConfig, arch: ArchConfig, num_kv_blocks: int, num_host_blocks: int,
               batches_in_flight: int | None) -> Scheduler:
    """The scheduler over the KV pool the workers allocated, with the step-time weights of this model's shape
    (``batches_in_flight``: pipeline stages', as their executor placed them)."""
    spec = config.speculative
    # a draft model writes its drafts' K/V before they are scheduled: slots past the scheduled tokens
    lookahead = spec.num_speculative_tokens if spec is not None and spec.uses_draft_model else 0
    weights = cost_weights(arch.hidden_size, arch.intermediate_size, arch.num_layers, arch.num_heads,
                           arch.num_kv_heads, arch.head_dim)
    return Scheduler(config.scheduler, config.cache, num_kv_blocks, num_host_blocks, num_lookahead_tokens=lookahead,
                     step_cost_weights=weights, batches_in_flight=batches_in_flight)


class EngineCore:
    """Schedules and runs batches of tokenized requests; see the module docstring."""

    def __init__(self, config: EngineConfig, arch: ArchConfig, tokenizer: Any) -> None:
        self.config = config
        self.hidden_size = arch.hidden_size
        self.embeds_width = arch.embeds_width
        self.last_step_features: list[float] = []
        """Scheduler.step_features of the last step (the step-time log of `pagedllm serve --step-log`)."""
        eos = load_eos_token_ids(config.model.model, arch, tokenizer)
        hand_on_tokenizer(config.model.model, tokenizer)  # (the grammar compiler's, loaded once per process)
        self.request_factory = _request_factory(config, arch, tokenizer, eos)
        """Checks requests against the model (and prepares their grammars) and makes their Requests; prompts come
        tokenized (the front's InputProcessor)."""
        check_fits(config, arch)  # weights + KV cache against the memory here, before anything is allocated
        self.executor = get_executor_class(config)(config, arch, eos)
        try:  # the workers' phases after their model loaded (worker/worker.py)
            self.num_kv_blocks = self.executor.determine_num_kv_blocks()
            self.num_host_blocks = self.executor.determine_num_host_blocks()
            self.executor.initialize_cache(self.num_kv_blocks, self.num_host_blocks)
            self.executor.compile_or_warm_up_model()
        except BaseException:
            self.executor.shutdown()
            raise
        depth = None if config.parallel.pipeline_parallel_size == 1 else self.executor.batches_in_flight
        self.scheduler = _scheduler(config, arch, self.num_kv_blocks, self.num_host_blocks, depth)
        self.batch_queue = None if depth is None else BatchQueue(self.scheduler, self.executor, depth)
        """Pipeline stages: batches in flight (engine/batch_queue.py); None: a step is one batch run to its end."""
        self.beam_search = BeamSearchManager(self.scheduler, eos, tokenizer)
        self._beam_seq_ids = itertools.count()
        self.loras: dict[int, LoRARequest] = {}
        """LoRA adapters added (checked by the workers), by lora_int_id."""
        self.lifecycle = Lifecycle(self, config.model.enable_sleep_mode)
        """Pause, sleep and wake-up (engine/lifecycle.py)."""
        # what start-up left (the model, torch's and transformers' modules: ~220k objects) is out of the cyclic
        # GC's reach from now on, as vLLM's core does: a full collection walked it all, ~90 ms a time, during
        # steps (all-MiniLM, 3,000 sentences: 2.16 s -> 2.06 s). Shutdown gives it back.
        gc.collect()
        gc.freeze()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> EngineCore:
        """Resolve the configuration, load the tokenizer and the model, size the KV pool."""
        config, arch = args.create_engine_config()
        return cls(config, arch, load_tokenizer(config.model.model))

    # ----------------------------------------------------------------------- requests
    def add_request(self, request: AddRequest) -> None:
        """Check the parameters against the model and queue the samples; on an error nothing is queued."""
        if isinstance(request.params, PoolingParams):
            return self._add_pooling_request(request)
        if not isinstance(request.params, SamplingParams):
            raise ValidationError.bad_value("sampling_params", request.params, "a SamplingParams")
        self._check_generates("a text generation request")
        self.lifecycle.check_admits()
        try:
            if request.lora_request is not None:
                self.add_lora(request.lora_request)
            samples = self.request_factory.make_requests(request.seq_ids, request.prompt_ids, request.params,
                                                         request.arrival_time, request.cache_salt, request.lora_request,
                                                         request.prompt_embeds)
            # the n samples of a prompt fork from the first once its prompt is computed (shared blocks)
            self.scheduler.add_request(samples[0], samples[1:])
        except BaseException:
            self.scheduler.finish_requests(request.seq_ids, RequestStatus.FINISHED_ABORTED)  # none of it left queued
            raise

    def _check_generates(self, what: str) -> None:
        """ValidationError naming the endpoint to use when this is a pooling model."""
        model = self.config.model
        if model.runner == "pooling":
            use = "/v1/embeddings (LLM.embed)" if model.convert == "embed" else "/classify or /v1/score (LLM.classify)"
            raise ValidationError(f"this model is a pooling model ({model.convert}): it does not take {what}; "
                                  f"use {use}, or /v1/score and /rerank for pairs", param="model",
                                  value=os.path.basename(model.model))

    def _add_pooling_request(self, request: AddRequest) -> None:
        model = self.config.model
        if model.runner != "pooling":
            raise ValidationError("this model generates text: embeddings, classes and scores need a pooling model "
                                  "(serve one with --runner pooling; --convert embed makes this one an embedder)",
                                  param="model", value=os.path.basename(model.model))
        if request.lora_request is not None:
            raise ValidationError.bad_value("lora_request", request.lora_request, "None for a pooling model")
        params = resolve_pooling_params(request.params, model, self.hidden_size)
        [seq_id] = request.seq_ids
        pooled = self.request_factory.pooling_request(seq_id, request.prompt_ids, params, request.arrival_time,
                                                      request.token_type_ids)
        self.scheduler.add_request(pooled)

    def add_beam_search(self, request: AddBeamSearch) -> None:
        """Queue a beam search; its one RequestOutput (the beam_width best sequences, best first) comes out of
        step() when it ends."""
        self._check_beam_search(request)
        seq_params = self.beam_search.sampling_params(request.params)
        if request.lora_request is not None:
            self.add_lora(request.lora_request)
        # "b": the core's own ids, never equal to a front's ("n:request_id")
        seq_id = f"b{next(self._beam_seq_ids)}:{request.request_id}"
        first = self.request_factory.make_requests([seq_id], request.prompt_ids, seq_params, request.arrival_time,
                                                   lora_request=request.lora_request)[0]
        self.scheduler.add_request(first)
        self.beam_search.add(request.request_id, request.text, first, request.params)

    def _check_beam_search(self, request: AddBeamSearch) -> None:
        """A beam search's own refusals: its params, its id, a model that generates, an engine that admits, a
        beam_width the logprobs bound allows."""
        params = request.params
        if not isinstance(params, BeamSearchParams):
            raise ValidationError.bad_value("params", params, "a BeamSearchParams")
        if request.request_id in self.beam_search.groups:
            raise ValidationError(f"request id {request.request_id!r} is already in use", param="request_id",
                                  value=request.request_id)
        self._check_generates("beam search")
        self.lifecycle.check_admits()
        most = self.request_factory.max_logprobs  # each step ranks 2 x beam_width candidates per beam, as vLLM
        if 2 * params.beam_width > most:
            raise ValidationError.bad_value("beam_width", params.beam_width,
                                            f"<= {most // 2} (half of max_logprobs, --max-logprobs)")

    def abort(self, request: Abort) -> None:
        """Free a request's samples now (or a beam search's beams)."""
        self.scheduler.finish_requests(request.seq_ids, RequestStatus.FINISHED_ABORTED)
        self.beam_search.abort(request.request_id)

    def stop(self, seq_ids: list[str]) -> None:
        """Finish samples a stop string ended (found by whoever detokenizes); unknown ids are ignored."""
        self.scheduler.finish_requests(seq_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        """Requests still to run: step() has work (none while paused with "keep" or asleep)."""
        return not self.lifecycle.frozen and self.scheduler.has_unfinished_requests()

    def abort_all(self) -> list[EngineCoreOutput]:
        """End every request now (a pause's "abort"): the samples' finishes ("abort") for their callers; beam
        searches end without one (their front fails them)."""
        seq_ids = [s for s in self.scheduler.requests if not self.beam_search.owns(s)]
        self.scheduler.finish_requests(list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED)
        for request_id in list(self.beam_search.groups):
            self.beam_search.abort(request_id)
        return [EngineCoreOutput(request_id=s, new_token_ids=[], finish_reason="abort") for s in seq_ids]

    # ----------------------------------------------------------------------- pause, sleep (engine/lifecycle.py)
    def pause(self, mode: str = "abort", clear_cache: bool = True) -> list[EngineCoreOutput]:
        """Pause generation (vLLM's pause_generation); the finishes of the requests "abort" ended."""
        return self.lifecycle.pause(mode, clear_cache, reject=check_mode(mode) != "keep")

    def resume(self) -> None:
        self.lifecycle.resume()

    def is_paused(self) -> bool:
        return self.lifecycle.paused

    def sleep(self, level: int = 1, mode: str = "abort") -> list[EngineCoreOutput]:
        """Pause, then release the KV pool (level 1) and the weights (level 2); the finishes "abort" made."""
        return self.lifecycle.sleep(level, mode)

    def release_kv_cache_memory(self) -> list[EngineCoreOutput]:
        """vLLM's: sleep level 1, only the KV cache asleep (the weights kept); the finishes the abort made."""
        return self.lifecycle.release_kv_cache()

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back what sleep released (``tags``: "weights", "kv_cache"; None: all); True once fully awake."""
        return self.lifecycle.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.lifecycle.is_sleeping()

    def collective_rpc(self, method: str | bytes, args: Any = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """A user's call of a worker method on every rank (engine/lifecycle.py); results in rank order."""
        return self.lifecycle.collective_rpc(method, args, kwargs)

    def step(self) -> StepOutputs:
        """Schedule one batch and run it: the samples' new tokens, the beam searches that ended, the counters.

        The batch also tells the workers which requests finished since the last step (an idle engine runs no
        step of its own for that: they learn it with the next real one)."""
        if self.batch_queue is not None:  # pipeline stages: several batches in flight
            core_outputs = self.batch_queue.step()
        else:
            scheduler_output = self.scheduler.schedule()
            self.last_step_features = self.scheduler.step_features(scheduler_output)
            start = time.perf_counter()
            runner_output = self.executor.execute_model(scheduler_output)
            core_outputs = self.scheduler.update_from_output(runner_output)
            self.scheduler.record_step_time(time.perf_counter() - start)  # teaches the step-time target's estimate
        beams = [o for o in core_outputs if self.beam_search.owns(o.request_id)]
        stored, evicted = self.scheduler.kv_cache_manager.block_pool.take_cache_changes()
        return StepOutputs(outputs=[o for o in core_outputs if not self.beam_search.owns(o.request_id)],
                           beam_outputs=self.beam_search.process(beams), stats=self.get_stats(),
                           cache_stored=[h & ROUTING_KEY_MASK for h in stored],
                           cache_evicted=[h & ROUTING_KEY_MASK for h in evicted])

    def report_cache_changes(self) -> None:
        """From now on each step's outputs name the blocks its prefix cache took in and evicted (a
        data-parallel replica: its front routes requests to where their prefix is)."""
        self.scheduler.kv_cache_manager.block_pool.track_cache_changes()

    # ----------------------------------------------------------------------- LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter on every worker (ValidationError if it does not fit the model); True if
        it was new. Requests naming an adapter not added yet add it first."""
        if self.config.lora is None:
            raise ValidationError("LoRA adapters need enable_lora=True", param="lora_request",
                                  value=getattr(lora_request, "lora_name", lora_request))
        if not isinstance(lora_request, LoRARequest):
            raise ValidationError.bad_value("lora_request", lora_request, "a LoRARequest")
        known = self.loras.get(lora_request.lora_int_id)
        if known == lora_request:
            return False
        self.call_workers("add_lora", (lora_request,))  # refuses an id taken by another adapter
        self.loras[lora_request.lora_int_id] = lora_request
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter no live request uses; False if it was not added."""
        users = [r.request_id for r in self.scheduler.requests.values()
                 if r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id]
        if users:
            raise ValidationError(f"LoRA adapter {lora_int_id} is in use by {len(users)} request(s)",
                                  param="lora_int_id", value=lora_int_id)
        if self.loras.pop(lora_int_id, None) is None:
            return False
        self.call_workers("remove_lora", (lora_int_id,))
        return True

    def list_loras(self) -> set[int]:
        """The ids of the adapters added."""
        return set(self.loras)

    def call_workers(self, method: str, args: tuple = ()) -> list[Any]:
        """``Worker.<method>(*args)`` on every rank, in rank order, once no batch is in flight."""
        if self.batch_queue is not None:
            self.batch_queue.drain()
        return self.executor.collective_rpc(method, args)

    # ----------------------------------------------------------------------- state
    def rank_memory_usage(self) -> list[dict[str, float]]:
        """Per tensor-parallel rank, in rank order: bytes of weights, of KV pools, and its process's RSS; its load's
        seconds and peak RSS (load_seconds, load_peak_rss_bytes)."""
        return self.call_workers("memory_usage")

    def kv_map(self, cells: bool = True) -> dict[str, Any]:
        """The KV pool now (between steps): each block's holder and the slots' accounting (core/kv_map.py)."""
        return kv_map(self.scheduler.kv_cache_manager, self.scheduler.requests, cells)

    def get_stats(self) -> EngineStats:
        """Counters (steps, preemptions, chunked prefills, max running) and KV usage now and at peak."""
        # a shallow copy (asdict's deep one was ~0.1 ms of every step); lists copied, so later steps leave it be
        counters = {k: list(v) if isinstance(v, list) else v for k, v in vars(self.scheduler.stats).items()}
        return EngineStats(**counters, num_kv_blocks=self.num_kv_blocks, block_size=self.config.cache.block_size)

    def ready_message(self) -> CoreReady:
        """What a front needs to know of this core once it is loaded."""
        return CoreReady(version=PROTOCOL_VERSION, config=self.config, vocab_size=self.request_factory.vocab_size,
                         eos_token_ids=list(self.request_factory.eos_token_ids), num_kv_blocks=self.num_kv_blocks,
                         stats=self.get_stats(), hidden_size=self.embeds_width)

    def shutdown(self) -> None:
        """Stop the executor's workers (processes, Ray actors); idempotent. What start-up froze goes back to the
        cyclic GC (what this engine held can be collected; another engine in the process only loses the speed)."""
        self.executor.shutdown()
        gc.unfreeze()
