"""Filling a model's parameters from (name, tensor) pairs: shared by every model family."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def load_into(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor, object]],
              may_be_missing: Iterable[str] = ()) -> None:
    """Copy each (parameter name, tensor, shard id) into the model (through the parameter's
    ``weight_loader`` when it has one: tensor-parallel slices, packed projections); every parameter
    must be filled exactly once, except ``may_be_missing`` (e.g. a tied LM head). A tensor of a module another
    pipeline stage holds is skipped (models/pipeline.py)."""
    from pagedllm.layers.quant import QuantTensor
    from pagedllm.models.pipeline import held_elsewhere, missing_prefixes

    params = dict(model.named_parameters())
    unfilled = set(params)
    elsewhere = missing_prefixes(model)
    for name, tensor, shard in weights:
        if elsewhere and name not in params and held_elsewhere(name, elsewhere):
            continue
        assert name in params, f"checkpoint tensor {name} has no parameter in the model"
        param = params[name]
        if isinstance(tensor, QuantTensor) and not getattr(param, "takes_quantized", False):
            tensor = tensor.dequantize()  # a parameter that keeps no quantized rows (e.g. a mixture's experts)
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            loader(param, tensor, shard)
        else:
            param.data.copy_(tensor)
        unfilled.discard(name)
    unfilled -= set(may_be_missing)
    assert not unfilled, f"parameters missing from the checkpoint: {sorted(unfilled)[:5]}"
