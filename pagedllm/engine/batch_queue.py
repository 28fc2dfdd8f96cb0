"""Several batches in flight through pipeline stages (vLLM's batch queue): while the last stage samples one
batch, the earlier stages already run the next ones, each of other requests (core/in_flight.py).

``step`` schedules batches until ``depth`` are in flight or nothing more can be scheduled (every running request
is in one, or waits for blocks), then waits for the oldest one's answer and updates the scheduler from it. A call
of the workers' other methods first ``drain``s the queue (their pipes carry one conversation at a time); what
the drained batches gave comes out of the next ``step``.
"""
from __future__ import annotations

import time
from collections import deque

from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.executor.base import Executor
from pagedllm.outputs import EngineCoreOutput


class BatchQueue:
    """Up to ``depth`` batches submitted to the executor and not yet answered, oldest first."""

    def __init__(self, scheduler: Scheduler, executor: Executor, depth: int) -> None:
        self.scheduler, self.executor, self.depth = scheduler, executor, depth
        self.pending: deque[float] = deque()
        """When each batch in flight was submitted."""
        self.drained: list[EngineCoreOutput] = []
        """What batches answered outside ``step`` (``drain``) gave, for the next step's outputs."""
        self._last_answer = time.perf_counter()

    def step(self) -> list[EngineCoreOutput]:
        """Fill the queue, then take the oldest batch's answer (none in flight: what draining left, if anything)."""
        self._fill()
        outputs, self.drained = self.drained, []
        if self.pending:
            outputs += self._answer_oldest()
        return outputs

    def drain(self) -> None:
        """Wait for every batch in flight, updating the scheduler from each."""
        while self.pending:
            self.drained += self._answer_oldest()

    def _fill(self) -> None:
        while len(self.pending) < self.depth:
            out = self.scheduler.schedule()
            if out.is_empty and not _carries(out):  # nothing to run or to tell the workers
                self.scheduler.retract(out)
                return
            self.executor.submit_model(out)
            self.pending.append(time.perf_counter())
            stats = self.scheduler.stats
            stats.max_batches_in_flight = max(stats.max_batches_in_flight, len(self.pending))
            if out.is_empty:
                return

    def _answer_oldest(self) -> list[EngineCoreOutput]:
        submitted = self.pending.popleft()
        outputs = self.scheduler.update_from_output(self.executor.collect_model())
        now = time.perf_counter()
        # the stages' time this batch took beyond the one before it (what one more batch costs)
        self.scheduler.record_step_time(now - max(submitted, self._last_answer))
        self._last_answer = now
        return outputs


def _carries(out: SchedulerOutput) -> bool:
    """A batch that schedules no token still tells the workers something: requests finished or preempted, block
    copies, tokens sampled for the earlier stages."""
    return bool(out.finished_req_ids or out.preempted_req_ids or out.blocks_to_copy or out.blocks_to_swap_out
                or out.blocks_to_swap_in or out.sampled_token_ids)
