"""The plain, picklable data the scheduler hands to workers each step.

Every class is keyword-only: a field added later cannot shift the meaning of a positional call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.lora_request import LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.prompt_embeds import PromptEmbeds
from pagedllm.sampling_params import SamplingParams


@dataclass(kw_only=True)
class NewRequestData:
    """A request the workers have not seen: everything needed to build its state."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    """Tokens generated before the workers saw it (beams forked mid-generation)."""
    lora_request: LoRARequest | None = None
    """The adapter it runs with (forked samples run with their leader's)."""
    pooling_params: PoolingParams | None = None
    """A pooling request's parameters (it is pooled, not sampled)."""
    token_type_ids: list[int] | None = None
    """Per prompt token, its segment (cross-encoder pairs); None: all 0."""
    prompt_embeds: PromptEmbeds | None = None
    """The prompt given as embeddings (``prompt_token_ids`` are its placeholders): the model takes these rows."""


@dataclass(kw_only=True)
class ForkedRequestData:
    """A sample that starts on its leader's blocks; its first token is sampled from the leader's logits."""

    req_id: str
    parent_id: str
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(kw_only=True)
class CachedRequestData:
    """A request the workers know: its new blocks and how far it is computed.

    ``replace_table`` (resumed after a preemption, or a block copied on write) means
    ``new_block_ids`` is the whole table, not an addition to it.
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    replace_table: bool = False


@dataclass(kw_only=True)
class SchedulerOutput:
    """One step's batch. Requests are in scheduling order; all tokens are flattened."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """Request id -> tokens computed for it this step."""
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished since the last step, however long ago (an idle engine runs no step just to
    send them): workers drop their state before running this one."""
    preempted_req_ids: set[str] = field(default_factory=set)
    forked_reqs: list[ForkedRequestData] = field(default_factory=list)
    """Samples starting this step; they sample from their parent's logits row."""
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    """(source, destination) device blocks to copy before the forward (copy-on-write)."""
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    """(device, host) blocks to copy out first (preempted by swapping)."""
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    """(host, device) blocks to copy back in before the forward."""
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Request -> the tokens the last pipeline stage sampled for it since the previous batch was scheduled (only
    with pipeline stages): the stages before it take them into their request states, as if sampled there."""
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Request -> the draft tokens verified this step: its last ``len(drafts)`` scheduled tokens (vLLM's name)."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
