"""What pipeline stages pass each other during a step (distributed/parallel_state.py ``get_pp_stage``).

A stage runs its layers over the step's tokens and sends the hidden states and the residual to the next stage's
rank of the same tensor-parallel index; the last stage samples (the scheduler sends the sampled tokens to every stage
with its next batch: worker/stage_runner.py). Every stage has the step's SchedulerOutput, so the sizes are known on
both ends: nothing but the tensors is sent.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pagedllm.distributed.parallel_state import get_tp_world_size


def send_to_next_stage(hidden: torch.Tensor, residual: torch.Tensor) -> None:
    """The stage's output (tokens, width) and residual, in one message to the next stage."""
    both = torch.stack([hidden, residual])  # (2, tokens, width): one send, not two
    dist.send(both.contiguous(), dst=dist.get_rank() + get_tp_world_size())


def recv_from_previous_stage(num_tokens: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual), each (num_tokens, width), as the previous stage sent them."""
    both = torch.empty(2, num_tokens, width, dtype=dtype)  # (2, tokens, width)
    dist.recv(both, src=dist.get_rank() - get_tp_world_size())
    return both[0], both[1]
