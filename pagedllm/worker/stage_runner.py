"""The model runner of a pipeline stage (pipeline_parallel_size > 1; distributed/pipeline.py).

Every stage prepares the step's inputs and runs its layers (the model sends and receives the hidden states). The
last stage then scores and samples as a whole model's runner would and shares the sampled tokens; every other
stage takes them into its request states, as if sampled there (its next input ids come from them). Only the last
stage's answer reaches the scheduler (ParallelConfig.answering_rank).
"""
from __future__ import annotations

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.distributed.parallel_state import PipelineStage, get_pp_stage
from pagedllm.distributed.pipeline import share_from_last_stage
from pagedllm.outputs import ModelRunnerOutput
from pagedllm.worker.input_batch import StepFailures
from pagedllm.worker.model_runner import ModelRunner, count_computed, take_tokens


class StageRunner(ModelRunner):
    """A ModelRunner whose model is one pipeline stage (made when the worker joined its stage)."""

    @property
    def stage(self) -> PipelineStage:
        stage = get_pp_stage()
        assert stage is not None, "a StageRunner runs in a pipeline stage"
        return stage

    def _run(self, out: SchedulerOutput, failures: StepFailures) -> ModelRunnerOutput:
        batch = self._prepare_inputs(out)
        hidden = self._forward(batch)
        if not self.stage.is_last:
            count_computed(batch)
            return self._take_shared(share_from_last_stage(None))
        result = self._score_and_sample(out, batch, hidden, failures)
        share_from_last_stage([(r, t) for r, t in zip(result.req_ids, result.sampled_token_ids) if t])
        return result

    def _take_shared(self, sampled: list[tuple[str, list[int]]]) -> ModelRunnerOutput:
        """The last stage's (request, tokens) taken into this stage's request states (not answered: not read)."""
        for req_id, tokens in sampled:
            state = self.requests.get(req_id)
            if state is not None:
                take_tokens(state, tokens)
        return ModelRunnerOutput(req_ids=[r for r, _ in sampled], sampled_token_ids=[t for _, t in sampled],
                                 logprobs=[None] * len(sampled))
