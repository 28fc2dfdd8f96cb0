"""Beam search on the paged engine: beams are sequences that fork and share blocks.

Every live beam is a scheduler request that computes one token per step and reports its top
2k log-probabilities (k = beam_width). Once all beams of a prompt have reported, the k best
continuations are chosen (transformers' rule, below); each becomes a new request forked from
its parent beam, so a beam that survives in c children is referenced c times and its partly
filled last block is copied on write. The parents are then released; blocks nobody holds any
more return to the pool.

The selection follows transformers' ``_beam_search`` (early_stopping=False): of the top 2k
candidates (parent score + token log-probability), the best k that do not end (EOS, or the
length limit) continue; those among the first k that end become finished hypotheses scored
cum_logprob / generated_length ** length_penalty (the k best are kept); the search stops when
every candidate ends or when k hypotheses are finished and the best live beam, scored at its
current length, cannot beat the worst of them.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.scheduler import Scheduler
from pagedllm.outputs import CompletionOutput, EngineCoreOutput, RequestOutput, TokenLogprobs
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Beam:
    seq_id: str
    tokens: list[int]
    """Generated tokens (the prompt excluded)."""
    cum_logprob: float


@dataclass
class _Candidate:
    score: float
    beam: _Beam
    token: int


@dataclass
class _Group:
    """The beams of one prompt."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: BeamSearchParams
    running: list[_Beam]
    finished: list[tuple[float, _Beam, str]] = field(default_factory=list)
    """(score, beam, finish reason), best first, at most beam_width."""
    reported: dict[str, TokenLogprobs] = field(default_factory=dict)
    num_generated: int = 0
    improvable: bool = True


class BeamSearchManager:
    """Drives the beam groups of an engine between its steps."""

    def __init__(self, scheduler: Scheduler, eos_token_ids: tuple[int, ...], tokenizer: Any) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}
        self.seq_to_group: dict[str, str] = {}
        self._ids = itertools.count()

    def sampling_params(self, params: BeamSearchParams) -> SamplingParams:
        """What each beam request asks of the model: its top 2k log-probabilities per step."""
        # one token per beam and step: the beams are forked from each step's top 2k, never speculated
        return SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True,
                              logprobs=2 * params.beam_width, speculate=False)

    def add(self, request_id: str, prompt: str | None, first: Request, params: BeamSearchParams) -> None:
        """Track a prompt whose first beam (``first``) the caller has queued in the scheduler."""
        self.groups[request_id] = _Group(request_id, prompt, first.prompt_token_ids, params,
                                         [_Beam(first.request_id, [], 0.0)])
        self.seq_to_group[first.request_id] = request_id

    def owns(self, seq_id: str) -> bool:
        return seq_id in self.seq_to_group

    def abort(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is not None:
            self._release(group.running)

    def process(self, outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Take the beams' new tokens; step every group whose beams have all reported. A group whose beam
        failed, or whose step raises, ends alone with an error output (its beams released)."""
        ready, results = [], []
        for out in outputs:
            group = self.groups.get(self.seq_to_group.get(out.request_id, ""))
            if group is None:  # its search already ended in this step
                continue
            if out.error is not None:
                results.append(self._fail(group, out.error))
                continue
            assert out.new_logprobs and out.new_logprobs[0] is not None
            group.reported[out.request_id] = out.new_logprobs[0]
            if len(group.reported) == len(group.running):
                ready.append(group)
            else:  # not decoded again (nor preempted) while its search waits for the other beams
                self.scheduler.hold(out.request_id)
        for group in ready:
            if group.request_id not in self.groups:  # failed by another of its beams
                continue
            try:
                result = self._step(group)
            except Exception as e:  # this search's own numbers: it fails alone, the engine goes on
                logger.warning("beam search %s failed: %r", group.request_id, e, exc_info=True)
                result = self._fail(group, f"the beam search step failed: {type(e).__name__}: {e}")
            if result is not None:
                results.append(result)
        return results

    def _fail(self, group: _Group, why: str) -> RequestOutput:
        """End a search with an error: its beams released, an output with no sequences and ``error`` set."""
        self._release(group.running)
        self.groups.pop(group.request_id, None)
        return RequestOutput(group.request_id, group.prompt, group.prompt_ids, [], True, error=why)

    def _step(self, group: _Group) -> RequestOutput | None:
        k, params = group.params.beam_width, group.params
        candidates = self._top_candidates(group)
        at_limit = group.num_generated + 1 >= params.max_tokens
        ends = [at_limit or (not params.ignore_eos and c.token in self.eos_token_ids) for c in candidates]
        survivors = [c for c, end in zip(candidates, ends) if not end][:k]
        group.num_generated += 1
        if group.improvable:
            self._finish_beams(group, candidates[:k], ends[:k], at_limit)
        if len(group.finished) == k and survivors:
            best_live = survivors[0].score / group.num_generated ** params.length_penalty
            group.improvable = group.improvable and best_live > group.finished[-1][0]
        if all(ends) or not group.improvable:
            self._release(group.running)
            del self.groups[group.request_id]
            return self._output(group)
        self._continue(group, survivors)
        return None

    def _finish_beams(self, group: _Group, candidates: list[_Candidate], ends: list[bool], at_limit: bool) -> None:
        """The candidates among the best beam_width that end here join the group's finished beams (the best
        beam_width kept), scored with the length penalty."""
        params = group.params
        for c, end in zip(candidates, ends):
            if end:
                beam = _Beam("", c.beam.tokens + [c.token], c.score)
                score = c.score / group.num_generated ** params.length_penalty
                group.finished.append((score, beam, "length" if at_limit and c.token not in self.eos_token_ids
                                       else "stop"))
        group.finished = sorted(group.finished, key=lambda f: -f[0])[:params.beam_width]

    def _top_candidates(self, group: _Group) -> list[_Candidate]:
        candidates = []
        for beam in group.running:
            lp = group.reported[beam.seq_id]
            candidates += [_Candidate(beam.cum_logprob + value, beam, token)
                           for token, value in zip(lp.top_token_ids, lp.top_logprobs)]
        candidates.sort(key=lambda c: -c.score)  # stable: ties keep beam order, then rank
        return candidates[: 2 * group.params.beam_width]

    def _continue(self, group: _Group, survivors: list[_Candidate]) -> None:
        """Fork each survivor from its parent beam, then release the parents."""
        parents = group.running
        group.running, group.reported = [], {}
        for c in survivors:
            parent = self.scheduler.requests[c.beam.seq_id]
            child = Request(f"beam{next(self._ids)}:{group.request_id}", parent.prompt_token_ids,
                            parent.sampling_params, parent.eos_token_ids, parent.max_tokens, parent.arrival_time)
            child.all_token_ids = parent.all_token_ids[:-1] + [c.token]  # the parent's sampled token is replaced
            self.scheduler.fork_request(parent.request_id, child)
            group.running.append(_Beam(child.request_id, c.beam.tokens + [c.token], c.score))
            self.seq_to_group[child.request_id] = group.request_id
        self._release(parents)

    def _release(self, beams: list[_Beam]) -> None:
        ids = [b.seq_id for b in beams]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)  # already gone: ignored
        for seq_id in ids:
            self.seq_to_group.pop(seq_id, None)

    def _output(self, group: _Group) -> RequestOutput:
        completions = [
            CompletionOutput(i, self.tokenizer.decode(beam.tokens, skip_special_tokens=True), beam.tokens,
                             beam.cum_logprob, None, reason)
            for i, (score, beam, reason) in enumerate(group.finished)]
        return RequestOutput(group.request_id, group.prompt, group.prompt_ids, completions, True)
