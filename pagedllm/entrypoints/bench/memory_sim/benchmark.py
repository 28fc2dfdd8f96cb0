"""The options of ``pagedllm bench memory`` and the run of every scheme on every trace."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedllm.entrypoints.bench.memory_sim.contiguous import ORCA_SCHEMES, simulate_contiguous
from pagedllm.entrypoints.bench.memory_sim.paged import PAGED, simulate_paged
from pagedllm.entrypoints.bench.memory_sim.series import PoolLimits, StepSeries, summarize
from pagedllm.entrypoints.bench.memory_sim.sharing import sharing_savings
from pagedllm.entrypoints.bench.traces import (
    TRACE_SPECS,
    TraceRequest,
    draw_lengths,
    make_trace,
    poisson_steps,
    saturating_rate,
)
from pagedllm.errors import ValidationError

SCHEMES = (PAGED, *ORCA_SCHEMES)
"""Every scheme, in the order of the results and tables."""


@dataclass(frozen=True)
class MemoryBenchConfig:
    """Options of ``pagedllm bench memory`` (see the package docstring)."""

    traces: tuple[str, ...] = ("sharegpt", "alpaca")
    num_requests: int = 1000
    request_rate: float | None = None
    """Arrivals per step; None: each trace's saturating rate."""
    seed: int = 0
    max_model_len: int = 2048
    block_size: int = 16
    kv_tokens: int = 32768
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    sharing_traces: tuple[str, ...] = ("alpaca",)
    sharing_widths: tuple[int, ...] = (2, 4, 6)
    beam_divergence: int = 32

    def __post_init__(self) -> None:
        bad = ValidationError.bad_value
        for name in ("traces", "sharing_traces"):
            unknown = [t for t in getattr(self, name) if t not in TRACE_SPECS]
            if unknown:
                raise bad(name, unknown, f"names among {sorted(TRACE_SPECS)}")
        for name in ("num_requests", "block_size", "max_num_seqs", "max_num_batched_tokens", "beam_divergence"):
            if getattr(self, name) < 1:
                raise bad(name, getattr(self, name), "a positive integer")
        if self.max_model_len < 8:
            raise bad("max_model_len", self.max_model_len, ">= 8")
        if self.request_rate is not None and not 0 < self.request_rate < math.inf:
            raise bad("request_rate", self.request_rate, "a positive finite number")
        if self.kv_slots < self.max_model_len:
            raise bad("kv_tokens", self.kv_tokens, f"at least max_model_len ({self.max_model_len}) slots")
        if any(w < 1 for w in self.sharing_widths):
            raise bad("sharing_widths", self.sharing_widths, "positive integers")

    @property
    def kv_slots(self) -> int:
        """Token slots of the pool: whole blocks only, the same for every scheme."""
        return self.kv_tokens // self.block_size * self.block_size

    def limits(self) -> PoolLimits:
        """The pool and per-step limits every scheme runs under."""
        return PoolLimits(self.kv_slots, self.block_size, self.max_model_len, self.max_num_seqs,
                          self.max_num_batched_tokens)


@dataclass
class TraceRun:
    """Everything measured on one trace."""

    name: str
    rate: float
    trace: list[TraceRequest]
    series: dict[str, StepSeries] = field(default_factory=dict)
    summary: dict[str, dict[str, float]] = field(default_factory=dict)


def build_trace(config: MemoryBenchConfig, name: str) -> tuple[list[TraceRequest], float]:
    """The seeded trace of ``name`` and the arrival rate used."""
    lengths = draw_lengths(TRACE_SPECS[name], config.num_requests, config.max_model_len, config.seed)
    rate = config.request_rate or saturating_rate(lengths, config.kv_slots)
    return make_trace(lengths, poisson_steps(config.num_requests, rate, config.seed, name)), rate


def run_trace(config: MemoryBenchConfig, name: str) -> TraceRun:
    """Run every scheme on one trace."""
    trace, rate = build_trace(config, name)
    run = TraceRun(name, rate, trace)
    limits = config.limits()
    run.series[PAGED], preemptions = simulate_paged(trace, limits, name)
    for scheme in ORCA_SCHEMES:
        run.series[scheme] = simulate_contiguous(trace, limits, scheme)
    for scheme, series in run.series.items():
        run.summary[scheme] = summarize(series, config.kv_slots)
    run.summary[PAGED]["num_preemptions"] = preemptions
    return run


def run_benchmark(config: MemoryBenchConfig) -> tuple[dict[str, Any], list[TraceRun]]:
    """The JSON-able result and the per-trace runs (for plotting)."""
    runs = [run_trace(config, name) for name in config.traces]
    sharing = {}
    for name in config.sharing_traces:
        trace = next((r.trace for r in runs if r.name == name), None) or build_trace(config, name)[0]
        sharing[name] = sharing_savings(trace, config.block_size, config.max_model_len, config.sharing_widths,
                                        config.beam_divergence, use_manager=True)
    result = {
        "config": {**asdict(config), "kv_slots": config.kv_slots},
        "traces": {r.name: trace_result(r) for r in runs},
        "sharing": sharing,
    }
    return result, runs


def trace_result(run: TraceRun) -> dict[str, Any]:
    """The JSON-able summary of one trace: its distribution, drawn means, rate and schemes."""
    return {
        "distribution": TRACE_SPECS[run.name].describe(),
        "mean_input_len": sum(r.prompt_len for r in run.trace) / len(run.trace),
        "mean_output_len": sum(r.output_len for r in run.trace) / len(run.trace),
        "request_rate_per_step": run.rate,
        "schemes": run.summary,
    }
