"""The worker's LoRA adapters: which ones are read into host memory, which sit in the max_loras
slots of the model's LoRA layers, and the rows of each adapter in the step about to run."""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from pagedllm.config import LoRAConfig
from pagedllm.errors import ValidationError
from pagedllm.lora.layers import LoRALinear, LoRAStep
from pagedllm.lora.peft import LoRATarget, LoRAWeights, load_adapter
from pagedllm.lora_request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    """Attaches a LoRALayer to each of the model's adaptable linear layers (before the weights are
    packed: a LoRA layer keeps gate_up unfused), then moves adapters host -> slots per step."""

    def __init__(self, model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.step = LoRAStep()
        self.targets: dict[str, LoRATarget] = {}
        self.layers: dict[str, LoRALinear] = {}
        packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
        supported = set(getattr(model, "supported_lora_modules", ()))
        for name, module in model.named_modules():
            prefix, _, leaf = name.rpartition(".")
            if leaf not in supported:
                continue
            in_features, slices = module.lora_shape()
            parts = tuple(zip([f"{prefix}.{p}" for p in packed.get(leaf, [leaf])], slices))
            self.targets[name] = LoRATarget(in_features, parts)
            module.lora = self.layers[name] = LoRALinear(in_features, slices, config.max_loras,
                                                         config.max_lora_rank, dtype, device, self.step)
        if not self.layers:
            raise ValidationError(f"enable_lora: LoRA is not supported for {type(model).__name__} yet",
                                  param="enable_lora", value=True)
        self.device, self.dtype = device, dtype
        self.host: OrderedDict[int, LoRAWeights] = OrderedDict()
        """Adapters read into host memory, least recently used first (at most max_cpu_loras)."""
        self.slots: list[int | None] = [None] * config.max_loras
        """The adapter id in each slot."""
        self.requests: dict[int, LoRARequest] = {}
        """Every adapter added (and not removed), by id: read again from disk when dropped from host."""

    def add(self, lora: LoRARequest) -> None:
        """Read and check an adapter (ValidationError names what is wrong), keep it in host memory."""
        known = self.requests.get(lora.lora_int_id)
        if known is not None and known != lora:
            raise ValidationError(f"lora_int_id {lora.lora_int_id} is already taken by another adapter",
                                  param="lora_request", value=lora.lora_name)  # not its path: it may be the operator's
        self._host(lora)
        self.requests[lora.lora_int_id] = lora

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (host copy and slot); False if it was not added."""
        self.host.pop(lora_int_id, None)
        self.slots = [None if s == lora_int_id else s for s in self.slots]
        return self.requests.pop(lora_int_id, None) is not None

    def list(self) -> list[int]:
        return sorted(self.requests)

    def prepare(self, loras: list[LoRARequest | None], query_start_loc: list[int]) -> bool:
        """Set the step's row mask (``loras``: each request's adapter, in batch order; request i's tokens
        are rows [query_start_loc[i], query_start_loc[i + 1])). True if any row runs an adapter."""
        used = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if not used:
            self.step.mask = None
            return False
        assert len(used) <= len(self.slots), "the scheduler admits at most max_loras adapters at once"
        slot_of = {lora_id: self._slot(lora, keep=set(used)) for lora_id, lora in used.items()}
        row_slot = torch.full((query_start_loc[-1],), -1, dtype=torch.long)  # (tokens,) -1: the base model
        for i, lora in enumerate(loras):
            if lora is not None:
                row_slot[query_start_loc[i]:query_start_loc[i + 1]] = slot_of[lora.lora_int_id]
        mask = row_slot[:, None] == torch.arange(len(self.slots))[None, :]  # (tokens, max_loras)
        self.step.mask = mask.to(self.dtype).unsqueeze(-1).to(self.device, non_blocking=True)  # (tokens, S, 1)
        return True

    def _slot(self, lora: LoRARequest, keep: set[int]) -> int:
        """The slot holding ``lora``, loading it into a free one or one whose adapter this step does not use."""
        if lora.lora_int_id in self.slots:
            return self.slots.index(lora.lora_int_id)
        slot = next((i for i, s in enumerate(self.slots) if s is None), None)
        if slot is None:
            slot = next(i for i, s in enumerate(self.slots) if s not in keep)
        weights = self._host(lora)
        for name, layer in self.layers.items():
            layer.set_slot(slot, weights.layers.get(name))
        self.slots[slot] = lora.lora_int_id
        return slot

    def _host(self, lora: LoRARequest) -> LoRAWeights:
        """The adapter's host copy (read from disk if it is not there), marked most recently used."""
        weights = self.host.get(lora.lora_int_id)
        if weights is None:
            weights = load_adapter(lora, self.targets, self.config.max_lora_rank)
            logger.info("LoRA adapter %r (id %d, rank %d) read from %s", lora.lora_name, lora.lora_int_id,
                        weights.rank, lora.lora_path)
            self.host[lora.lora_int_id] = weights
            while len(self.host) > self.config.max_cpu_loras:
                self.host.popitem(last=False)
        self.host.move_to_end(lora.lora_int_id)
        return weights
