"""A model split into pipeline stages (distributed/parallel_state.py ``get_pp_stage``): each stage builds only
its own layers; the layers other stages hold, and the embedding or LM head it does not run, are ``PPMissingLayer``
placeholders (no weights: the checkpoint's tensors for them are skipped at load, ``missing_prefixes``)."""
from __future__ import annotations

from torch import nn


class PPMissingLayer(nn.Identity):
    """A module another pipeline stage holds: no parameters here, never run."""


def missing_prefixes(model: nn.Module) -> frozenset[str]:
    """The names of the placeholders in ``model`` ("model.layers.7", "lm_head"): a checkpoint tensor under one of
    them belongs to another stage."""
    return frozenset(name for name, module in model.named_modules() if isinstance(module, PPMissingLayer))


def held_elsewhere(name: str, prefixes: frozenset[str]) -> bool:
    """Whether the parameter ``name`` ("model.layers.7.mlp.down_proj.weight") is under one of ``prefixes``."""
    parts = name.split(".")
    return any(".".join(parts[:i]) in prefixes for i in range(1, len(parts)))
