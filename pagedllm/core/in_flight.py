"""Batches scheduled and not yet answered, for pipeline stages that keep several in flight (engine/batch_queue.py);
requests held out of the batches.

A request is in at most one of them: the scheduler passes over a request in flight (its next token is not known
yet) and never preempts one (its blocks are being written). What the last stage sampled reaches the stages
before it through the next batch scheduled (SchedulerOutput.sampled_token_ids), as vLLM's pipeline does.
"""
from __future__ import annotations

from collections import Counter, deque

from pagedllm.core.scheduler_output import SchedulerOutput


class InFlight:
    """The requests of each batch scheduled and not yet updated from, oldest first."""

    def __init__(self, pipeline_stages: bool = False) -> None:
        self.pipeline_stages = pipeline_stages
        """Tracked only for pipeline stages (one batch at a time otherwise: schedule, run, update), where each
        batch also carries the tokens sampled since the previous one."""
        self._batches: deque[frozenset[str]] = deque()
        self._count: Counter[str] = Counter()
        self._sampled: dict[str, list[int]] = {}
        self._held: set[str] = set()

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._held or self._count[req_id] > 0

    def hold(self, req_id: str) -> None:
        """Keep a request out of the batches (and safe from preemption) until it finishes, as if in flight: a beam
        that reported, waiting for its search's other beams (engine/beam_search.py)."""
        self._held.add(req_id)

    def finished(self, req_ids: list[str]) -> None:
        """These requests finished: no longer held."""
        self._held.difference_update(req_ids)

    def scheduled(self, out: SchedulerOutput) -> None:
        """``out`` goes out: its requests (forked samples too) are in flight; it carries what was sampled."""
        if not self.pipeline_stages:
            return
        batch = frozenset(out.num_scheduled_tokens) | {f.req_id for f in out.forked_reqs}
        self._batches.append(batch)
        self._count.update(batch)
        out.sampled_token_ids, self._sampled = self._sampled, {}

    def answered(self, sampled: dict[str, list[int]]) -> None:
        """The oldest batch's results are in (``sampled``: request -> its new tokens)."""
        if not self.pipeline_stages:
            return
        if self._batches:
            self._forget(self._batches.popleft())
        for req_id, tokens in sampled.items():
            self._sampled.setdefault(req_id, []).extend(tokens)

    def retract(self, out: SchedulerOutput) -> None:
        """``out`` (the newest batch, scheduling nothing) is not sent after all: what it carried waits for the next."""
        if not self.pipeline_stages:
            return
        self._forget(self._batches.pop())
        for req_id, tokens in out.sampled_token_ids.items():
            self._sampled[req_id] = tokens + self._sampled.get(req_id, [])

    def _forget(self, batch: frozenset[str]) -> None:
        for req_id in batch:
            self._count[req_id] -= 1
            if self._count[req_id] <= 0:
                del self._count[req_id]
