"""What a front end keeps of its requests between sending them to its engine core and their end, shared by the
offline ``LLMEngine`` and the serving ``AsyncLLM``: the input processor that makes the core's messages, the
output processor that detokenizes the samples' outputs, the beam searches running (their one output comes from
the core), the id check, and the Abort that stops a request in the core."""
from __future__ import annotations

import itertools
import time
from collections.abc import Container
from typing import Any

from pagedllm.engine.messages import Abort, AddBeamSearch, AddRequest, CoreReady
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.processor import InputProcessor, PromptType
from pagedllm.errors import ValidationError
from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import BeamSearchParams, SamplingParams


class FrontRequests:
    """The request bookkeeping of a front end (the base of LLMEngine and AsyncLLM)."""

    def __init__(self, tokenizer: Any, ready: CoreReady, log_stats: bool) -> None:
        """The bookkeeping of a front end whose core is ready (``ready``: what the core said at start)."""
        self.config = ready.config
        self.tokenizer = tokenizer
        self.num_kv_blocks: int = ready.num_kv_blocks
        self.processor = InputProcessor.for_core(tokenizer, ready)
        """Tokenizes and checks prompts into the core's messages (the server reads its bounds too)."""
        self.output_processor = OutputProcessor(tokenizer, log_stats)
        self._seq_counter = itertools.count()
        """Numbers the samples' ids ("n:request_id"): made here, users' ids can never collide with them."""
        self._beams: set[str] = set()
        """Beam searches running (their one RequestOutput comes from the core)."""

    def _check_new_id(self, request_id: str, *taken: Container[str]) -> None:
        """ValidationError naming request_id when a live request (or one of ``taken``: e.g. still being sent)
        holds it."""
        if request_id in self.output_processor.requests or request_id in self._beams or \
                any(request_id in ids for ids in taken):
            raise ValidationError(f"request id {request_id!r} is already in use", param="request_id", value=request_id)

    def _core_request(self, request_id: str, prompt: PromptType, params: SamplingParams | BeamSearchParams,
                      arrival_time: float | None, lora_request: LoRARequest | None
                      ) -> tuple[str | None, AddRequest | AddBeamSearch]:
        """(prompt text, the message the core takes) of a user's request (InputProcessor.core_request)."""
        return self.processor.core_request(request_id, prompt, params, arrival_time or time.monotonic(),
                                           lora_request, self._seq_counter)

    def _track(self, request_id: str, text: str | None, request: AddRequest | AddBeamSearch) -> None:
        """Remember a request sent to the core: its samples' outputs to detokenize, or a beam search."""
        if isinstance(request, AddRequest):
            self.output_processor.add_request(request_id, text, request.prompt_ids, request.params, request.seq_ids,
                                              request.arrival_time)
        else:
            self._beams.add(request_id)

    def _untrack(self, request_id: str) -> None:
        """Forget a request the core refused or never got (no statistics: it never ran)."""
        self.output_processor.discard(request_id)
        self._beams.discard(request_id)

    def _forget(self, request_id: str) -> Abort | None:
        """Forget a live request here (its unfinished samples end as aborted); the Abort that stops it in the core,
        None when this front end does not know it."""
        if request_id in self._beams:
            self._beams.discard(request_id)
            return Abort(request_id=request_id, seq_ids=[])
        if request_id in self.output_processor.requests:
            seq_ids = self.output_processor.seq_ids(request_id)
            self.output_processor.abort(request_id)
            return Abort(request_id=request_id, seq_ids=seq_ids)
        return None
