"""Turns the scheduler's per-sequence news into RequestOutputs (n samples per request)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.outputs import CompletionOutput, EngineCoreOutput, Logprob, RequestOutput, TokenLogprobs
from pagedllm.sampling_params import SamplingParams


@dataclass
class SequenceState:
    """One sample of a request, as the user will see it."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def completion(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.detokenizer.output_text, list(self.token_ids),
                                self.cumulative_logprob, self.logprobs, self.finish_reason, self.stop_reason)


@dataclass
class RequestState:
    """A user request: its prompt and its n sequences (keyed by the scheduler's request ids)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[str, SequenceState]

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences.values())

    def output(self) -> RequestOutput:
        completions = [s.completion() for s in sorted(self.sequences.values(), key=lambda s: s.index)]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, self.finished)


class OutputProcessor:
    """Detokenizes new tokens, applies stop strings and assembles outputs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.seq_to_request: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, seq_ids: list[str]) -> None:
        sequences = {}
        for index, seq_id in enumerate(seq_ids):
            seq = SequenceState(index, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params))
            if params.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            sequences[seq_id] = seq
            self.seq_to_request[seq_id] = request_id
        self.requests[request_id] = RequestState(request_id, prompt, prompt_token_ids, params, sequences)

    def seq_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return list(state.sequences) if state else []

    def abort(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        for seq_id in (state.sequences if state else []):
            del self.seq_to_request[seq_id]

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """(RequestOutputs of the requests that changed, sequence ids ended by a stop string)."""
        changed: dict[str, RequestState] = {}
        stopped_by_string: list[str] = []
        for out in outputs:
            state = self.requests[self.seq_to_request[out.request_id]]
            seq = state.sequences[out.request_id]
            seq.token_ids.extend(out.new_token_ids)
            if seq.logprobs is not None:
                self._add_logprobs(seq, out.new_token_ids, out.new_logprobs, state.params.logprobs)
            stop = seq.detokenizer.update(out.new_token_ids, out.finish_reason == "stop")
            if stop is not None:
                if out.finish_reason is None:
                    stopped_by_string.append(out.request_id)
                seq.finish_reason, seq.stop_reason = "stop", stop
            elif out.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
            changed[state.request_id] = state
        results = []
        for request_id, state in changed.items():
            results.append(state.output())
            if state.finished:
                self.abort(request_id)
        return results, stopped_by_string

    def _add_logprobs(self, seq: SequenceState, token_ids: list[int], logprobs: list[TokenLogprobs | None],
                      top_n: int) -> None:
        for token_id, lp in zip(token_ids, logprobs):
            assert lp is not None
            entry = {tid: Logprob(val, rank + 1, self.tokenizer.decode([tid]))
                     for rank, (tid, val) in enumerate(zip(lp.top_token_ids[:top_n], lp.top_logprobs[:top_n]))}
            entry.setdefault(token_id, Logprob(lp.sampled_logprob, lp.sampled_rank, self.tokenizer.decode([token_id])))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += lp.sampled_logprob
