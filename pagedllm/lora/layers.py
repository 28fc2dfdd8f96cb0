"""The LoRA side of a linear layer: every loaded adapter's matrices stacked in slots, and the
delta of one step for all its rows at once (S-LoRA / Punica style: the base weight is never merged,
so rows of different adapters and of none share a step).

A slot holds an adapter's A matrices of the layer's packed projections (q, k, v / gate, up / the
layer itself) stacked, (parts * rank, in), and its B matrices block-diagonal, (out, parts * rank).
A step's delta is two matmuls, whatever the number of adapters in it: every row is shrunk by every
slot's A, the columns of the slots a row does not run are zeroed (the step's row mask), and the
result expands through all slots' B at once. (A loop over adapters, gathering each one's rows,
costs four small ops per adapter and layer: at decode batch sizes the dispatch, not the math, is
what costs.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class LoRAStep:
    """Which rows of this step run which slot; shared by every LoRA layer of a model."""

    mask: torch.Tensor | None = None
    """(tokens, max_loras, 1) in the model's dtype: 1 where the row runs that slot; None: no adapter in
    the step (the layers add nothing)."""


class LoRALinear:
    """The adapters' matrices of one linear layer, one slot each, and their delta for a step."""

    def __init__(self, in_features: int, part_rows: list[int], max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, step: LoRAStep) -> None:
        self.part_rows = part_rows
        self.max_rank = max_rank
        self.step = step
        self.width = len(part_rows) * max_rank
        self.a = torch.zeros(max_loras, self.width, in_features, dtype=dtype, device=device)  # (slots, W, in)
        # (out, slots, W): the slots side by side, one (out, slots * W) matrix for the expand
        self.b = torch.zeros(sum(part_rows), max_loras, self.width, dtype=dtype, device=device)

    def set_slot(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None] | None) -> None:
        """Put one adapter's (A, scaled B) per projection in ``slot`` (None: the adapter leaves this layer alone)."""
        self.a[slot].zero_()
        self.b[:, slot].zero_()
        row = 0
        for index, rows in enumerate(self.part_rows):
            pair = parts[index] if parts is not None else None
            if pair is not None:
                a, b = pair  # (r, in), (rows, r): zero-padded to max_rank
                col = index * self.max_rank
                self.a[slot, col:col + a.shape[0]].copy_(a)
                self.b[row:row + rows, slot, col:col + b.shape[1]].copy_(b)
            row += rows

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (tokens, out) += each row's adapter delta, x (tokens, in)."""
        slots = self.a.shape[0]
        # every slot, used or not: views of the stacked tensors, no copy (an empty slot's columns are zeroed)
        shrunk = (x @ self.a.view(slots * self.width, -1).T).view(x.shape[0], slots, self.width)  # (tokens, S, W)
        shrunk = shrunk * self.step.mask  # each row keeps its own slot's columns
        return out.add_(shrunk.view(x.shape[0], slots * self.width) @ self.b.view(self.b.shape[0], -1).T)
