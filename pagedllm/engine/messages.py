"""What a front end and an engine core say to each other: one keyword-only record per kind of message.

The same records serve every client (engine/core_client.py): handed over as objects to a core in this
process, sent by field name (engine/serial.py, the class name is the kind) to a core in its own process.
A new field is added with a default and both sides read it by name, so nothing shifts; a change an older
peer cannot read bumps PROTOCOL_VERSION, which the handshake (StartCore, CoreReady) checks.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pagedllm.core.scheduler import SchedulerStats

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.lora_request import LoRARequest
    from pagedllm.outputs import EngineCoreOutput, RequestOutput
    from pagedllm.pooling_params import PoolingParams
    from pagedllm.prompt_embeds import PromptEmbeds
    from pagedllm.sampling_params import BeamSearchParams, SamplingParams

PROTOCOL_VERSION = 1
"""The message set's version: a front and a core process of different versions refuse each other at the start."""


_PER_REPLICA_MAXIMA = ("max_step_attended_positions", "max_batches_in_flight", "step_time_decode_s",
                       "step_time_token_s", "step_time_pair_s", "last_step_estimated_s", "max_step_estimated_s",
                       "max_step_estimated_fraction")
"""Statistics of one replica's steps: several replicas' are their maximum, not their sum."""


@dataclasses.dataclass(kw_only=True)
class EngineStats(SchedulerStats):
    """Scheduler counters plus the facts of this engine's KV pool (sent after each step)."""

    num_kv_blocks: int = 0
    block_size: int = 0

    @classmethod
    def combine(cls, parts: list[EngineStats]) -> EngineStats:
        """Several replicas' statistics as one engine's: counts (and most running at once) summed, KV usage and
        its peak weighted by each replica's blocks."""
        if len(parts) == 1:
            return parts[0]
        total = cls()
        for f in dataclasses.fields(cls):
            setattr(total, f.name, _combined(f.name, [getattr(p, f.name) for p in parts], parts))
        return total


# ---------------------------------------------------------------------------- front -> core
@dataclasses.dataclass(kw_only=True)
class StartCore:
    """The first message to a core process: the engine to load; a core of another ``version`` refuses it."""

    version: int
    engine_args: EngineArgs
    step_log: str | None = None
    """With a path: one JSON line per step, its features and seconds (`pagedllm plan --calibrate-from`)."""
    report_cache: bool = False
    """Report each step's prefix-cache changes (StepOutputs.cache_stored/cache_evicted): a data-parallel
    replica, for its front's routing."""


@dataclasses.dataclass(kw_only=True)
class AddRequest:
    """A tokenized request and the ids of its ``params.n`` samples (made by the front)."""

    request_id: str
    seq_ids: list[str]
    prompt_ids: list[int]
    params: SamplingParams | PoolingParams
    """PoolingParams: a pooling request (one sample, its vector out)."""
    arrival_time: float
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    token_type_ids: list[int] | None = None
    """A pooling request's segment ids (cross-encoder pairs)."""
    prompt_embeds: PromptEmbeds | None = None
    """A prompt given as embeddings (enable_prompt_embeds): ``prompt_ids`` are then its placeholders, one per row."""


@dataclasses.dataclass(kw_only=True)
class AddBeamSearch:
    """A tokenized beam search: the core runs it whole and answers one RequestOutput (``text``: the prompt's)."""

    request_id: str
    text: str | None
    prompt_ids: list[int]
    params: BeamSearchParams
    arrival_time: float
    lora_request: LoRARequest | None = None


@dataclasses.dataclass(kw_only=True)
class Abort:
    """Stop a request now: its samples ``seq_ids`` (none for a beam search: the core knows its beams)."""

    request_id: str
    seq_ids: list[str]


@dataclasses.dataclass(kw_only=True)
class Stop:
    """Samples that a stop string ended (the front detokenizes, so it finds them)."""

    seq_ids: list[str]


@dataclasses.dataclass(kw_only=True)
class Call:
    """Run one of the core's CALLS between two steps; answered by a Reply with the same ``call_id``."""

    call_id: int
    method: str
    args: list[Any]


@dataclasses.dataclass(kw_only=True)
class Shutdown:
    """Stop the loop; the core process then stops its workers and exits."""


# ---------------------------------------------------------------------------- core -> front
@dataclasses.dataclass(kw_only=True)
class CoreError:
    """An exception as plain data: its type's name, its message, and a ValidationError's param and value."""

    type: str
    message: str
    param: str | None = None
    value: Any = None


def _combined(name: str, values: list[Any], parts: list[EngineStats]) -> Any:
    """One EngineStats field over the replicas (EngineStats.combine)."""
    if name in ("kv_cache_usage", "max_kv_cache_usage"):
        blocks = sum(p.num_kv_blocks for p in parts)
        return sum(v * p.num_kv_blocks for v, p in zip(values, parts)) / blocks if blocks else 0.0
    if name == "block_size":
        return values[0]
    if name == "max_num_running":
        return sum(values)
    if name in _PER_REPLICA_MAXIMA:  # each replica steps on its own
        return max(values)
    if isinstance(values[0], list):  # per-position counts
        return [sum(v[i] for v in values if i < len(v)) for i in range(max(map(len, values)))]
    return sum(values)


@dataclasses.dataclass(kw_only=True)
class CoreReady:
    """The core is loaded: what the front needs to know of it."""

    version: int
    config: EngineConfig
    vocab_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    stats: EngineStats
    hidden_size: int = 0
    """The model's embedding width (what a prompt given as embeddings must have per row)."""


@dataclasses.dataclass(kw_only=True)
class StartupError:
    """The core could not start (a bad argument, a model that does not load, another protocol version)."""

    error: CoreError


@dataclasses.dataclass(kw_only=True)
class Accepted:
    """A request was queued (``error`` None) or refused; sent in the order the core took them."""

    request_id: str
    error: CoreError | None = None


@dataclasses.dataclass(kw_only=True)
class StepOutputs:
    """After each step (and after aborts): the samples' new tokens, the beam searches that finished, and the
    counters now."""

    outputs: list[EngineCoreOutput]
    beam_outputs: list[RequestOutput]
    stats: EngineStats
    cache_stored: list[int] = dataclasses.field(default_factory=list)
    """A data-parallel replica's report: routing keys (core/kv_cache_manager.py) of blocks its prefix cache took
    in during the step ..."""
    cache_evicted: list[int] = dataclasses.field(default_factory=list)
    """... and of blocks it evicted."""
    engine_index: int = 0
    """Which data-parallel replica stepped (set by the front's client, engine/dp_client.py)."""


@dataclasses.dataclass(kw_only=True)
class Reply:
    """The answer to a Call: its result, or its error."""

    call_id: int
    error: CoreError | None = None
    result: Any = None


@dataclasses.dataclass(kw_only=True)
class CoreDead:
    """The loop failed (a worker died, a bug): no request can be served any more."""

    error: CoreError


FrontMessage = AddRequest | AddBeamSearch | Abort | Stop | Call | Shutdown
CoreMessage = Accepted | StepOutputs | Reply | CoreDead
MESSAGE_TYPES: tuple[type, ...] = (StartCore, AddRequest, AddBeamSearch, Abort, Stop, Call, Shutdown, CoreError,
                                   CoreReady, StartupError, Accepted, StepOutputs, Reply, CoreDead)
"""Every record above (engine/serial.py may carry these and no other of this module)."""
