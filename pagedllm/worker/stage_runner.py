"""The model runner of a pipeline stage (pipeline_parallel_size > 1; distributed/pipeline.py).

Every stage prepares the step's inputs and runs its layers (the model sends and receives the hidden states). The
last stage then scores and samples as a whole model's runner would; only its answer reaches the scheduler
(ParallelConfig.answering_rank), which sends the sampled tokens with its next batch (SchedulerOutput
.sampled_token_ids): every other stage takes them into its request states before that batch, as if sampled there
(its next input ids come from them). No stage waits for the others' step: several batches can be in flight.
"""
from __future__ import annotations

from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.distributed.parallel_state import PipelineStage, get_pp_stage
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

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """A stage before the last takes what the last one sampled for earlier batches, then runs this one."""
        if not self.stage.is_last:
            for req_id, tokens in out.sampled_token_ids.items():
                state = self.requests.get(req_id)
                if state is not None:  # (else finished, or preempted since)
                    take_tokens(state, tokens)
        return super().execute_model(out)

    def _run(self, out: SchedulerOutput, failures: StepFailures) -> ModelRunnerOutput:
        batch = self._prepare_inputs(out)
        hidden = self._forward(batch)
        if not self.stage.is_last:  # its hidden states went on to the next stage; nothing to answer
            count_computed(batch)
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[])
        return self._score_and_sample(out, batch, hidden, failures)
