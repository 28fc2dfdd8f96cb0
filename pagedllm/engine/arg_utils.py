"""EngineArgs: every user-facing engine option with vLLM's names (``LLM(**kwargs)``, ``pagedllm serve``'s flags),
as vLLM's ``vllm.engine.arg_utils.EngineArgs``. Its fields are pagedllm.config.options.EngineOptions'; adding an
option is a field there (the CLI's typed flag follows: entrypoints/cli_args.py) and its resolution in
engine/arg_resolve.py (or a config's own check in pagedllm/config/).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.config import EngineConfig
from pagedllm.config.options import EngineOptions
from pagedllm.models.config import ArchConfig

if TYPE_CHECKING:
    from pagedllm.worker.memory_plan import RankBytes


@dataclass(kw_only=True)
class EngineArgs(EngineOptions):
    """Every user-facing engine option (the fields: pagedllm.config.options.EngineOptions) and their resolution."""

    def create_engine_config(self) -> tuple[EngineConfig, ArchConfig]:
        """Every option resolved against the model's files and this machine, or refused (ValidationError naming
        it); with the model's architecture, read once here (the workers are given it)."""
        # torch and the model loaders load only when an engine is built: the CLI imports this class for its flags
        from pagedllm.engine.arg_resolve import engine_config

        return engine_config(self)

    def rank_memory_plan(self) -> list[RankBytes]:
        """What each rank of the engine these options make would hold, in rank order: its stage's layers' weights
        (its tensor-parallel share) and its KV pool as asked (worker/memory_plan.py), from the config and the
        checkpoint's shapes alone: nothing is loaded."""
        from pagedllm.worker.memory_fit import plan_ranks

        return plan_ranks(*self.create_engine_config())
