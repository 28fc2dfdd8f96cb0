"""Turns the scheduler's per-sequence news into RequestOutputs (n samples per request).

Also gathers each step's timing facts (time to first token, inter-token latencies, finished
requests) for metrics, whatever kind of outputs the caller asked for.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class FinishedRequestStats:
    """One finished sequence, for request-level metrics."""

    finish_reason: str
    e2e_latency: float
    queue_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int = 0
    """Prompt tokens whose K/V came from the prefix cache."""
    prefill_time: float | None = None
    """First scheduled to first token (None: no token, or never scheduled)."""
    decode_time: float | None = None
    """First token to last token (None: no token)."""
    inference_time: float | None = None
    """First scheduled to last token."""
    time_per_output_token: float | None = None
    """decode_time over the tokens after the first (0 with one token)."""
    max_tokens: int | None = None
    """The request's max_tokens (None: not given, or a pooling request)."""
    request_n: int | None = None
    """Set on the last sample of a request to finish: the request's number of samples ..."""
    request_max_generation_tokens: int | None = None
    """... and the most tokens one of them generated."""


@dataclass
class IterationStats:
    """What one step produced, for metrics (all times in seconds)."""

    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    num_prompt_tokens: int = 0
    """Prompt tokens of the sequences that got their first token (vLLM's prompt-token count) ..."""
    num_cached_prompt_tokens: int = 0
    """... and of those, the ones found in the prefix cache."""


@dataclass
class SequenceState:
    """One sample of a request, as the user will see it."""

    index: int
    detokenizer: IncrementalDetokenizer | None
    """None for a pooling request (no text)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None
    first_token_time: float | None = None
    sent_text: int = 0
    """DELTA outputs: characters / tokens already handed out, and whether the finish was."""
    sent_tokens: int = 0
    sent_finish: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self, kind: RequestOutputKind, interval: int = 1) -> CompletionOutput | None:
        """The sequence as a CompletionOutput; for DELTA only what is new (None if nothing is, or if fewer than
        ``interval`` new tokens gathered since the last one handed out, its first and its end excepted)."""
        text = self.detokenizer.text_for_stream(self.finished)  # never shows what a stop string may cut
        if kind != RequestOutputKind.DELTA:
            return CompletionOutput(self.index, text, list(self.token_ids), self.cumulative_logprob,
                                    None if self.logprobs is None else list(self.logprobs),
                                    self.finish_reason, self.stop_reason)
        if (len(text) == self.sent_text and len(self.token_ids) == self.sent_tokens
                and self.finished == self.sent_finish):
            return None
        if not self.finished and self.sent_tokens and len(self.token_ids) - self.sent_tokens < interval:
            return None  # stream_interval: gathered into the next chunk
        delta = CompletionOutput(self.index, text[self.sent_text:], self.token_ids[self.sent_tokens:],
                                 self.cumulative_logprob,
                                 None if self.logprobs is None else self.logprobs[self.sent_tokens:],
                                 self.finish_reason, self.stop_reason)
        self.sent_text, self.sent_tokens, self.sent_finish = len(text), len(self.token_ids), self.finished
        return delta


@dataclass
class RequestState:
    """A user request: its prompt and its n sequences (keyed by the scheduler's request ids)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[str, SequenceState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_reported: bool = False
    prompt_id_scores: Any = None
    """prompt_logprob_token_ids' scores once the engine sent them: float32 [rows, ids] (numpy)."""
    error: str | None = None
    """Why the request failed (one of its samples' handling raised): every sample then ends with "error"."""
    pooled: list[float] | None = None
    """A pooling request's vector, once the engine sent it."""

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences.values())

    def output(self) -> RequestOutput | PoolingRequestOutput | None:
        """This step's RequestOutput in the request's output kind (None: nothing to report); a pooling
        request's PoolingRequestOutput when it is done."""
        if isinstance(self.params, PoolingParams):
            return PoolingRequestOutput(self.request_id, PoolingOutput(self.pooled or []), self.prompt_token_ids,
                                        True, self.prompt, self.error) if self.finished else None
        kind = self.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        ordered = sorted(self.sequences.values(), key=lambda s: s.index)
        interval = self.params.stream_interval
        completions = [c for c in (s.completion(kind, interval) for s in ordered) if c is not None]
        if not completions:
            return None
        prompt_logprobs, id_scores = self.prompt_logprobs, self.prompt_id_scores
        if kind == RequestOutputKind.DELTA and self.prompt_logprobs_reported:
            prompt_logprobs = id_scores = None  # a stream carries them once
        self.prompt_logprobs_reported = self.prompt_logprobs is not None or self.prompt_id_scores is not None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, self.finished,
                             self.num_cached_tokens, self.metrics, prompt_logprobs, id_scores, self.error)


def _set_finish(seq: SequenceState, out: EngineCoreOutput, stop: str | None) -> None:
    """A sample's finish: by the stop string its text reached, else as the core ended it (if it did)."""
    if stop is not None:
        seq.finish_reason, seq.stop_reason = "stop", stop
    elif out.finish_reason is not None:
        seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason


class OutputProcessor:
    """Detokenizes new tokens, applies stop strings and assembles outputs."""

    def __init__(self, tokenizer: Any, log_stats: bool = False) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        """Gather IterationStats (someone must take them, or they pile up)."""
        self.requests: dict[str, RequestState] = {}
        self.seq_to_request: dict[str, str] = {}
        self.iteration_stats = IterationStats()

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams, seq_ids: list[str], arrival_time: float) -> None:
        sequences = {}
        for index, seq_id in enumerate(seq_ids):
            # a pooling request's one sequence has no text: its vector comes whole with the finish
            detokenizer = None if isinstance(params, PoolingParams) else \
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            seq = SequenceState(index, detokenizer)
            if detokenizer is not None and params.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            sequences[seq_id] = seq
            self.seq_to_request[seq_id] = request_id
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, sequences,
                                                 RequestMetrics(arrival_time))

    def seq_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return list(state.sequences) if state else []

    def abort(self, request_id: str) -> None:
        """Forget an unfinished request; its unfinished sequences count as finished by "abort"."""
        state = self.requests.get(request_id)
        if state is None:
            return
        now = time.monotonic()
        for seq in state.sequences.values():
            if not seq.finished:
                seq.finish_reason = "abort"
                self._record_finished(state, seq, now)
        self._forget(request_id)

    def discard(self, request_id: str) -> None:
        """Forget a request the engine core refused (it never ran: no statistics)."""
        if request_id in self.requests:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        state = self.requests.pop(request_id)
        for seq_id in state.sequences:
            del self.seq_to_request[seq_id]

    def take_iteration_stats(self) -> IterationStats:
        """The timing facts gathered since the last call (the caller reports them once)."""
        stats, self.iteration_stats = self.iteration_stats, IterationStats()
        return stats

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(RequestOutputs of the requests that changed, sequence ids ended by a stop string)."""
        now = time.monotonic()
        changed: dict[str, RequestState] = {}
        stopped_by_string: list[str] = []
        for out in outputs:
            owner = self.seq_to_request.get(out.request_id)
            if owner is None:  # aborted, or ended by a stop string, while a core process ran one more step
                continue
            state = self.requests[owner]
            seq = state.sequences[out.request_id]
            if seq.finished:  # the same race for one of n samples: its request is still open
                continue
            changed[state.request_id] = state
            if out.error is not None:
                stopped_by_string += self._fail(state, out.error, now)
                continue
            if out.pooling_output is not None:
                self._record_timing(state, seq, out, now)
                state.pooled, seq.finish_reason = out.pooling_output, out.finish_reason or "stop"
                self._record_finished(state, seq, now)
                continue
            try:
                self._update(state, seq, out, now, stopped_by_string)
            except Exception as e:  # this request's detokenizing or logprobs: it fails alone
                logger.warning("request %s failed in the output processor: %r", state.request_id, e, exc_info=True)
                stopped_by_string += self._fail(state, f"processing the output failed: {type(e).__name__}: {e}", now)
        results = []
        for request_id, state in changed.items():
            if state.finished:
                state.metrics.finished_time = now
                self._forget(request_id)
            result = state.output()
            if result is not None:
                results.append(result)
        return results, stopped_by_string

    def _update(self, state: RequestState, seq: SequenceState, out: EngineCoreOutput, now: float,
                stopped_by_string: list[str]) -> None:
        """One sample's news: tokens, logprobs, text, stop strings, finish."""
        self._record_timing(state, seq, out, now)
        before = seq.detokenizer.num_output_tokens
        stop = seq.detokenizer.update(out.new_token_ids, out.finish_reason == "stop")
        # a stop string ends the output at the token that completed it (a step may bring several: speculation)
        new = out.new_token_ids if stop is None else out.new_token_ids[:seq.detokenizer.num_output_tokens - before]
        seq.token_ids.extend(new)
        if seq.logprobs is not None:
            self._add_logprobs(seq, new, out.new_logprobs, state.params.logprobs)
        if out.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = self._prompt_logprobs(state, out.prompt_logprobs)
        if out.prompt_token_id_logprobs is not None and state.prompt_id_scores is None:
            state.prompt_id_scores = np.asarray(out.prompt_token_id_logprobs, dtype=np.float32)  # (rows, ids)
        if stop is not None and out.finish_reason is None:
            stopped_by_string.append(out.request_id)  # (the core has not seen it end: it is told to stop it)
        _set_finish(seq, out, stop)
        if seq.finished:
            self._record_finished(state, seq, now)

    def _fail(self, state: RequestState, why: str, now: float) -> list[str]:
        """End every unfinished sample of a failed request with "error"; the ids the engine must still stop."""
        state.error = state.error or why
        running = []
        for seq_id, seq in state.sequences.items():
            if not seq.finished:
                seq.finish_reason = "error"
                self._record_finished(state, seq, now)
                running.append(seq_id)
        return running

    def _record_timing(self, state: RequestState, seq: SequenceState, out: EngineCoreOutput, now: float) -> None:
        metrics = state.metrics
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = out.first_scheduled_time
        if not out.new_token_ids:
            return
        previous, seq.last_token_time = seq.last_token_time, now
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        if previous is None:
            seq.first_token_time = now
        if self.log_stats and previous is None:
            self.iteration_stats.time_to_first_tokens.append(now - metrics.arrival_time)
            self.iteration_stats.num_prompt_tokens += len(state.prompt_token_ids)
            self.iteration_stats.num_cached_prompt_tokens += state.num_cached_tokens
        elif self.log_stats:
            self.iteration_stats.inter_token_latencies.append(now - previous)

    def _record_finished(self, state: RequestState, seq: SequenceState, now: float) -> None:
        if not self.log_stats:
            return
        first = state.metrics.first_scheduled_time
        stats = FinishedRequestStats(
            seq.finish_reason, now - state.metrics.arrival_time,
            None if first is None else first - state.metrics.arrival_time,
            len(state.prompt_token_ids), len(seq.token_ids), state.num_cached_tokens,
            max_tokens=None if isinstance(state.params, PoolingParams) else state.params.max_tokens)
        first_token, last_token = seq.first_token_time, seq.last_token_time
        if first_token is not None and last_token is not None:
            stats.decode_time = last_token - first_token
            stats.time_per_output_token = stats.decode_time / (len(seq.token_ids) - 1) \
                if len(seq.token_ids) > 1 else 0.0
            if first is not None:
                stats.prefill_time, stats.inference_time = first_token - first, last_token - first
        if all(s.finished for s in state.sequences.values()):  # the request's last sample
            stats.request_n = len(state.sequences)
            stats.request_max_generation_tokens = max(len(s.token_ids) for s in state.sequences.values())
        self.iteration_stats.finished.append(stats)

    def _prompt_logprobs(self, state: RequestState, scored: list[TokenLogprobs | None]
                         ) -> list[dict[int, Logprob] | None]:
        """[None (the first token), then per prompt token: it and the top-N, as Logprob entries (None before
        prompt_logprob_start + 1)]."""
        top_n, start = state.params.prompt_logprobs or 0, state.params.prompt_logprob_start or 0
        assert all(lp is not None for lp in scored[start:]), "every prompt row is scored before the first output"
        return [None, *(None if lp is None else self._entry(t, lp, top_n)
                        for t, lp in zip(state.prompt_token_ids[1:], scored))]

    def _entry(self, token_id: int, lp: TokenLogprobs, top_n: int) -> dict[int, Logprob]:
        """One position: the top-N tokens and the token itself (with its rank), decoded."""
        ranks = lp.top_ranks or range(1, top_n + 1)  # (logprob_token_ids: their own ranks; else the top-N's order)
        entry = {tid: Logprob(val, rank, self.tokenizer.decode([tid]))
                 for rank, tid, val in zip(ranks, lp.top_token_ids[:top_n], lp.top_logprobs[:top_n])}
        entry.setdefault(token_id, Logprob(lp.sampled_logprob, lp.sampled_rank, self.tokenizer.decode([token_id])))
        return entry

    def _add_logprobs(self, seq: SequenceState, token_ids: list[int], logprobs: list[TokenLogprobs | None],
                      top_n: int) -> None:
        for token_id, lp in zip(token_ids, logprobs):
            assert lp is not None
            seq.logprobs.append(self._entry(token_id, lp, top_n))
            seq.cumulative_logprob += lp.sampled_logprob
