"""The offline front end: tokenize, hand tokenized requests to the engine core in this thread, step, detokenize."""
from __future__ import annotations

import logging
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core import EngineCore
from pagedllm.engine.core_client import InprocClient
from pagedllm.engine.dp_sync import SyncDPClient
from pagedllm.engine.front_requests import FrontRequests
from pagedllm.engine.messages import Abort, AddRequest, EngineStats
from pagedllm.engine.output_processor import IterationStats
from pagedllm.engine.processor import PromptType
from pagedllm.errors import ValidationError
from pagedllm.lora_request import LoRARequest
from pagedllm.models.loader import load_tokenizer, resolve_model_path
from pagedllm.models.registry import supported_models  # noqa: F401  (re-exported for the CLI)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


def get_tokenizer(model: str | None = None) -> Any:
    """The tokenizer of ``model`` (default: the default model), as the engine would load it."""
    return load_tokenizer(resolve_model_path(model))


class LLMEngine(FrontRequests):
    """The offline API's engine (``LLM.llm_engine``): ``add_request``, then ``step()`` until done; one step is one
    batch of the engine core, reached through an InprocClient (``engine_core``)."""

    def __init__(self, core: EngineCore | SyncDPClient, tokenizer: Any, log_stats: bool = False) -> None:
        """``core``: the engine core to step in this thread, or data-parallel replicas (engine/dp_sync.py)."""
        self.engine_core: InprocClient | SyncDPClient = core if isinstance(core, SyncDPClient) else InprocClient(core)
        ready = core.ready if isinstance(core, SyncDPClient) else core.ready_message()
        super().__init__(tokenizer, ready, log_stats)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, log_stats: bool = False) -> LLMEngine:
        """Build an engine; ``log_stats`` gathers per-step timing (take it with take_iteration_stats). With
        ``data_parallel_size`` > 1 its replicas are processes (engine/dp_sync.py) and this one only steps them."""
        if args.data_parallel_size != 1:
            replicas = SyncDPClient(args)
            return cls(replicas, replicas.tokenizer, log_stats)
        config, arch = args.create_engine_config()
        tokenizer = load_tokenizer(config.model.model)
        return cls(EngineCore(config, arch, tokenizer), tokenizer, log_stats)

    # ----------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        """Validate and queue a request (with a LoRA adapter: ``lora_request``); on ValidationError nothing is
        queued."""
        self._check_new_id(request_id)
        params = params if params is not None else SamplingParams()
        text, request = self._core_request(request_id, prompt, params, arrival_time, lora_request)
        assert isinstance(request, AddRequest)
        self.engine_core.add(request)
        try:
            self._track(request_id, text, request)
        except BaseException:
            self.engine_core.abort(Abort(request_id=request_id, seq_ids=request.seq_ids))  # none of it left queued
            raise

    def add_beam_request(self, request_id: str, prompt: PromptType, params: BeamSearchParams,
                         arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        """Queue a beam search; its one RequestOutput holds the beam_width best sequences, best first."""
        if not isinstance(params, BeamSearchParams):
            raise ValidationError.bad_value("params", params, "a BeamSearchParams")
        self._check_new_id(request_id)
        _, request = self._core_request(request_id, prompt, params, arrival_time, lora_request)
        self.engine_core.add(request)
        self._track(request_id, None, request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests now and free their blocks."""
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.engine_core.abort(self._forget(request_id) or Abort(request_id=request_id, seq_ids=[]))

    def has_unfinished_requests(self) -> bool:
        """Requests still to run: step() has work."""
        return self.engine_core.has_unfinished_requests()

    # ----------------------------------------------------------------------- the loop
    def step(self) -> list[RequestOutput]:
        """Schedule one batch, run it, and return the outputs of the requests it advanced."""
        out = self.engine_core.step()
        news, stopped = self.output_processor.process(out.outputs)
        if stopped:
            self.engine_core.stop(stopped)
        for beam in out.beam_outputs:
            self._beams.discard(beam.request_id)
        return news + out.beam_outputs

    # ----------------------------------------------------------------------- LoRA adapters, state
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter on every worker (ValidationError if it does not fit the model); True if
        it was new. Requests naming an adapter not added yet add it first."""
        return self.engine_core.call("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter no live request uses; False if it was not added."""
        return self.engine_core.call("remove_lora", lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters added."""
        return set(self.engine_core.call("list_loras"))

    def rank_memory_usage(self) -> list[dict[str, float]]:
        """Per tensor-parallel rank, in rank order: bytes of weights, of KV pools, and its process's RSS; its load's
        seconds and peak RSS (load_seconds, load_peak_rss_bytes)."""
        return self.engine_core.call("rank_memory_usage")

    def kv_map(self, cells: bool = True) -> dict[str, Any]:
        """The KV pool now (between steps): each block's holder and the slots' accounting (core/kv_map.py)."""
        return self.engine_core.kv_map(cells)

    def get_stats(self) -> EngineStats:
        """Counters (steps, preemptions, chunked prefills, max running) and KV usage now and at peak."""
        return self.engine_core.call("get_stats")

    # ----------------------------------------------------------------------- pause, sleep, workers (lifecycle.py)
    def pause(self, mode: str = "abort", clear_cache: bool = True) -> list[RequestOutput]:
        """Pause generation (vLLM's pause_generation; "wait" with requests in flight is refused here); the final
        outputs of the requests "abort" ended."""
        return self._ended(self.engine_core.call("pause", mode, clear_cache), mode)

    def resume(self) -> None:
        self.engine_core.call("resume")

    def is_paused(self) -> bool:
        return self.engine_core.call("is_paused")

    def sleep(self, level: int = 1, mode: str = "abort") -> list[RequestOutput]:
        """Pause, then release the KV pool (level 1) and the weights (level 2) until wake_up."""
        return self._ended(self.engine_core.call("sleep", level, mode), mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return self.engine_core.call("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.call("is_sleeping")

    def collective_rpc(self, method: str | bytes, args: tuple = (), kwargs: dict[str, Any] | None = None
                       ) -> list[Any]:
        return self.engine_core.call("collective_rpc", method, args, kwargs)

    def _ended(self, outputs: list[Any], mode: str) -> list[RequestOutput]:
        """The RequestOutputs of core outputs a pause made (its aborted requests' finishes)."""
        if mode == "abort":  # (beam searches ended too, without an output)
            self._beams.clear()
        return self.output_processor.process(outputs)[0]

    def take_iteration_stats(self) -> IterationStats:
        """Timing facts since the last call: times to first token, inter-token latencies, finished requests."""
        return self.output_processor.take_iteration_stats()

    def shutdown(self) -> None:
        """Stop the executor's workers (processes, Ray actors); idempotent."""
        self.engine_core.shutdown()
