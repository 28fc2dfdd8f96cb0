"""What every scheme of the memory simulator shares: the pool's limits and the per-step accounting."""
from __future__ import annotations

from dataclasses import dataclass, field

CATEGORIES = ("token_states", "reserved", "internal", "external")
"""Kinds of slot use the percentages split the busy memory into (see the package docstring)."""


@dataclass(frozen=True)
class PoolLimits:
    """The KV pool and per-step limits every scheme shares."""

    kv_slots: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class StepSeries:
    """Slots per category at every busy step of one scheme's run."""

    steps: list[int] = field(default_factory=list)
    token_states: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    internal: list[int] = field(default_factory=list)
    external: list[int] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)

    def add(self, step: int, token_states: int, reserved: int, internal: int, external: int, batch: int) -> None:
        """Record one busy step: slots per category and the number of requests that ran."""
        assert min(token_states, reserved, internal, external) >= 0 and batch > 0, (
            step, token_states, reserved, internal, external, batch)
        self.steps.append(step)
        self.token_states.append(token_states)
        self.reserved.append(reserved)
        self.internal.append(internal)
        self.external.append(external)
        self.batch.append(batch)

    def held(self) -> list[int]:
        """Slots allocated or reserved to requests at each step."""
        return [t + r + i for t, r, i in zip(self.token_states, self.reserved, self.internal)]


def summarize(series: StepSeries, kv_slots: int) -> dict[str, float]:
    """Percentages of the non-unused memory (ratio of sums over busy steps), mean batch, steps."""
    totals = {c: sum(getattr(series, c)) for c in CATEGORIES}
    denom = sum(totals.values())
    assert denom > 0 and series.steps, "no busy step"
    summary = {f"{c}_pct": 100.0 * totals[c] / denom for c in CATEGORIES}
    summary["waste_pct"] = 100.0 - summary["token_states_pct"]
    summary["held_pct_of_pool"] = 100.0 * sum(series.held()) / (kv_slots * len(series.steps))
    summary["mean_batch"] = sum(series.batch) / len(series.batch)
    summary["busy_steps"] = len(series.steps)
    summary["last_step"] = series.steps[-1]
    return summary
