"""Seeded synthetic request traces, shared by ``bench memory`` and the ``*-like`` datasets.

Each length is drawn from a lognormal with the given mean and log-space standard deviation
sigma, rounded, then clipped: prompt to [4, max_model_len - 4], output to
[4, max_model_len - prompt], so ``prompt + output <= max_model_len``.

- ``sharegpt`` (ShareGPT-like): input mean 161 tokens, sigma 1.2; output mean 338, sigma 0.8.
- ``alpaca``: input mean 19 tokens, sigma 0.6; output mean 58, sigma 0.9.

The means are those the PagedAttention paper gives for its datasets (before clipping).
Arrivals are a Poisson process in *steps* (one step = one scheduler iteration = one model
forward): request i arrives at step floor(t_i), with exponential gaps of mean 1 / rate.
"""
from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceSpec:
    """Lognormal length distributions of one synthetic trace."""

    name: str
    mean_input: float
    sigma_input: float
    mean_output: float
    sigma_output: float

    def describe(self) -> str:
        """One line naming the trace and its two distributions."""
        return (f"{self.name}: input lognormal(mean {self.mean_input:g}, sigma {self.sigma_input:g}), "
                f"output lognormal(mean {self.mean_output:g}, sigma {self.sigma_output:g})")


TRACE_SPECS = {
    "sharegpt": TraceSpec("sharegpt", mean_input=161, sigma_input=1.2, mean_output=338, sigma_output=0.8),
    "alpaca": TraceSpec("alpaca", mean_input=19, sigma_input=0.6, mean_output=58, sigma_output=0.9),
}


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives and how long it is."""

    index: int
    arrival_step: int
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def lognormal_length(rng: random.Random, mean: float, sigma: float) -> int:
    """A rounded lognormal draw whose (unclipped) mean is ``mean``."""
    mu = math.log(mean) - sigma * sigma / 2  # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2)
    return round(rng.lognormvariate(mu, sigma))


def draw_lengths(spec: TraceSpec, num: int, max_model_len: int, seed: int) -> list[tuple[int, int]]:
    """``num`` (prompt, output) pairs, clipped so that 4 <= each and prompt + output <= max_model_len."""
    rng = random.Random(f"{seed}-{spec.name}-lengths")
    pairs = []
    for _ in range(num):
        prompt = min(max(lognormal_length(rng, spec.mean_input, spec.sigma_input), 4), max_model_len - 4)
        output = min(max(lognormal_length(rng, spec.mean_output, spec.sigma_output), 4), max_model_len - prompt)
        pairs.append((prompt, output))
    return pairs


def saturating_rate(lengths: Iterable[tuple[int, int]], kv_slots: int) -> float:
    """Arrivals per step at which the offered K/V (Little's law) equals the pool."""
    lengths = list(lengths)
    token_steps = sum(out * (prompt + (out - 1) / 2) for prompt, out in lengths) / len(lengths)
    return kv_slots / token_steps


def poisson_steps(num: int, rate: float, seed: int, name: str) -> list[int]:
    """Arrival steps of a Poisson process with ``rate`` arrivals per step."""
    rng = random.Random(f"{seed}-{name}-arrivals")
    now, steps = 0.0, []
    for _ in range(num):
        now += rng.expovariate(rate)
        steps.append(int(now))
    return steps


def make_trace(lengths: list[tuple[int, int]], arrivals: list[int]) -> list[TraceRequest]:
    """Pair each (prompt, output) length with its arrival step, in order."""
    return [TraceRequest(i, step, prompt, out) for i, (step, (prompt, out)) in enumerate(zip(arrivals, lengths))]
