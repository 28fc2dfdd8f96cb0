"""Request: one sequence the scheduler tracks, from arrival to finish (pure Python)."""
from __future__ import annotations

import enum
import time
from collections.abc import Iterable

from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.prompt_embeds import PromptEmbeds
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is. Values above PREEMPTED are finished states."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI / vLLM finish_reason string of a finished state."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """A sequence: its tokens, how many of them have K/V in the cache, and its state.

    There are no prefill/decode phases: the request needs compute while
    ``num_computed_tokens < num_tokens``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: int | Iterable[int] | None,
        max_tokens: int,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        token_type_ids: list[int] | None = None,
        prompt_embeds: PromptEmbeds | None = None,
    ) -> None:
        """A pooling request (``pooling_params`` set) carries a neutral ``sampling_params`` and max_tokens 0: it
        is computed whole in one step and ends with its vector, never sampling."""
        assert prompt_token_ids, "validated before a Request is made"
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids: tuple[int, ...] = (
            () if eos_token_ids is None
            else (eos_token_ids,) if isinstance(eos_token_ids, int)
            else tuple(eos_token_ids))
        """Tokens that end the sequence (the tokenizer's EOS and the checkpoint's extra ones)."""
        self.max_tokens = max_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.cache_salt = cache_salt
        """Mixed into the first block's hash: only requests with the same salt share cached blocks."""
        self.lora_request = lora_request
        """The LoRA adapter it runs with (None: the base model)."""
        self.block_hashes: list[int] = []
        """Chained hashes of the full blocks of all_token_ids (filled by the KV cache manager)."""
        self.num_cached_tokens = -1
        """Prompt tokens found in the prefix cache at first scheduling (-1 before)."""
        self.prompt_logprobs: list | None = (
            None if sampling_params.prompt_logprobs is None else [None] * (len(prompt_token_ids) - 1))
        """With prompt_logprobs: the TokenLogprobs of prompt tokens 1 .. P-1 as the workers score them."""
        rows = sampling_params.prompt_logprob_token_ids
        self.prompt_id_scores: list | None = None if rows is None else [None] * len(rows)
        """With prompt_logprob_token_ids: per scored row, the log-probabilities of its ids as the workers score
        them (sent with prompt_logprobs)."""
        self.prompt_logprobs_sent = False
        self.spec_token_ids: list[int] = []
        """Draft tokens the proposer offered after the last step (verified in the next one, if scheduled)."""
        self.pooling_params = pooling_params
        """Set for a pooling request (embedding, classification, score): its output is one vector."""
        self.token_type_ids = token_type_ids
        """Per prompt token, its segment (BERT-style pair inputs of cross-encoders); None: all 0."""
        self.prompt_embeds = prompt_embeds
        """The prompt given as embeddings (its token ids are placeholders): the workers feed these rows instead."""

    @property
    def block_hash_salt(self) -> str | None:
        """What the first block's hash mixes in: the cache salt and the adapter (K/V differ per adapter)."""
        return block_hash_salt(self.cache_salt, self.lora_request, self.prompt_embeds)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")


def block_hash_salt(cache_salt: str | None, lora_request: LoRARequest | None,
                    prompt_embeds: PromptEmbeds | None = None) -> str | None:
    """What a request's first block hash mixes in: its cache salt, its adapter's id (K/V differ per adapter) and the
    digest of a prompt given as embeddings (its placeholder ids say nothing: its blocks are shared only with prompts
    of the same embeddings)."""
    salt = cache_salt if lora_request is None else f"{cache_salt or ''}\x00lora:{lora_request.lora_int_id}"
    if prompt_embeds is None:
        return salt
    return f"{salt or ''}\x00embeds:{prompt_embeds.digest}"
