"""Plain-data outputs: what the worker returns per step and what users get per request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """Log-probability of one token at one position (vLLM's shape)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per generated position: token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(kw_only=True)
class TokenLogprobs:
    """Log-probabilities for one sampled position, as plain lists (crosses the worker seam)."""

    sampled_logprob: float
    sampled_rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]
    top_ranks: list[int] | None = None
    """With logprob_token_ids: the rank of each of top_token_ids (those ids, not the top-N; None: their order)."""


@dataclass(kw_only=True)
class ModelRunnerOutput:
    """What one model step produced: per scheduled request, the sampled tokens (maybe none)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None]
    """Per request, one entry per sampled token (None: no logprobs asked)."""
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    """Request -> (position of the first scored prompt token, one entry per prompt token this step
    scored): for requests with prompt_logprobs, the prompt tokens their chunk predicts."""
    prompt_id_scores: dict[str, tuple[int, list[list[float]]]] = field(default_factory=dict)
    """Request -> (its first scored row this step, per row the log-probabilities of its prompt_logprob_token_ids;
    -inf for a -1 pad)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Request -> why its own preparation or sampling failed this step (its seed, grammar): the scheduler
    finishes it with an error; the other requests of the step are not touched."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Request -> draft tokens proposed to follow its tokens (speculative decoding), verified next step."""
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    """Pooling request -> its vector (embedding, class probabilities, score): the request is done."""


@dataclass(kw_only=True)
class EngineCoreOutput:
    """The scheduler's per-request news after a step: new tokens, and the finish if any."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    """time.monotonic() when the request was first scheduled (for queue-time metrics)."""
    num_cached_tokens: int = 0
    """Prompt tokens whose K/V came from the prefix cache."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With a request's first token: the log-probabilities of prompt tokens 1 .. P-1 (prompt_logprobs)."""
    prompt_token_id_logprobs: list[list[float]] | None = None
    """With a request's first token: prompt_logprob_token_ids' scores, a row per scored prompt row."""
    error: str | None = None
    """With finish_reason "error": what failed (this request alone; the engine goes on)."""
    pooling_output: list[float] | None = None
    """A pooling request's vector (it comes with the finish)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's fields)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of one request (time.monotonic() seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The outputs of one request so far (vLLM's fields)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With SamplingParams.prompt_logprobs: per prompt position, the prompt token's and the top-N
    log-probabilities (None for the first position, which nothing predicts)."""
    prompt_token_id_logprobs: Any = None
    """With SamplingParams.prompt_logprob_token_ids: a float32 numpy array [rows, ids] of those tokens'
    log-probabilities at each scored prompt row (vLLM's; -inf where a row was padded with -1)."""
    error: str | None = None
    """Set when handling this request failed inside the engine (its samples finish with finish_reason
    "error"); the server answers it as an error, other requests are not disturbed."""


@dataclass
class BeamSearchSequence:
    """One finished beam: the whole sequence (prompt included, as vLLM returns it)."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float
    """cum_logprob / generated_length ** length_penalty: what beams are ranked by."""
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class PoolingOutput:
    """A pooling request's vector (vLLM's ``PoolingOutput``): an embedding, class probabilities or a score."""

    data: list[float]


@dataclass
class PoolingRequestOutput:
    """The output of one pooling request (vLLM's fields): ``outputs.data`` is its vector."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    error: str | None = None
    """Set when the engine failed this request alone (the server answers it as an error)."""


@dataclass
class EmbeddingOutput:
    """An embedding (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """Class probabilities (raw logits with use_activation=False), in label order (vLLM's ``ClassificationOutput``)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """The score of one pair (vLLM's ``ScoringOutput``): a cross-encoder's, or the cosine of two embeddings."""

    score: float


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s answer per prompt (vLLM's fields)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationRequestOutput:
    """``LLM.classify``'s answer per prompt (vLLM's fields)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s answer per pair (vLLM's fields)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
