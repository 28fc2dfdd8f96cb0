"""The estimated time of an engine step, learned from measured ones (SchedulerConfig.step_time_target).

A step's prefill part (its prompt chunks) does ``T = tokens * token_weight`` and ``A = attended_pairs *
attention_weight`` units of work: model FLOPs-like weights the engine core derives from the model's shape
(``cost_weights``); how many seconds each kind takes depends on the machine and its kernels (attention on a CPU
runs several times slower per FLOP than the matrix products), so both are learned. Measured step times teach:

- ``decode_s``: a moving average of the time of steps that only decode;
- the prefill's seconds as ``alpha * T + beta * A``: a least-squares fit, older steps weighing less (DECAY), of
  each step's (time - decode_s when it also decoded) over steps with a prompt chunk of at least MIN_SAMPLE_TOKENS
  tokens (a smaller one's time is mostly the step's fixed cost). Until steps differ enough in their share of
  attention to tell the two apart, beta = PRIOR_ATTENTION_RATIO x alpha.

Pure Python, no clock: it is given the measurements, so the scheduler's tests are exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field


def attended_positions(start: int, count: int, window: int | None = None) -> int:
    """Query x key positions ``count`` tokens from position ``start`` attend: the token at position p attends
    p + 1 (causal), at most ``window`` (a sliding window)."""
    if window is None:
        return count * start + count * (count + 1) // 2
    growing = max(0, min(start + count, window) - start)  # tokens below position `window` attend p + 1, others window
    return growing * start + growing * (growing + 1) // 2 + (count - growing) * window


UNMEASURED_CHUNK_TOKENS = 256
"""Beside decodes, before any prefill was measured, a step's prefill costs at most this many tokens from position 0."""
MIN_SAMPLE_TOKENS = 16
"""Fewest prompt tokens in a step whose time teaches the prefill fit."""
DECAY = 0.7
"""Weight left to the earlier steps at each new one: the fit follows a machine whose load changes."""
DECODE_RISE, DECODE_FALL = 0.5, 0.2
"""Weights of a new decode-only step in decode_s when it is above / below it: a slow step is believed faster."""
PRIOR_ATTENTION_RATIO = 3.0
"""Seconds per attention unit over seconds per token unit, assumed while the steps measured barely differ in their
share of attention: a 2-vCPU AMD EPYC's attention ran 2.5-3x slower per FLOP than its matrix products
(SmolLM2-135M, bf16; docs/BENCHMARKS.md); too small a chunk costs a little time, too big a one the gap."""
RIDGE = 1e-3
"""How strongly that prior holds (against the variance of the attention shares measured, which lie in [0, 1])."""


def cost_weights(hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> tuple[float, float]:
    """(token_weight, attention_weight) of a dense decoder: 2 FLOPs per non-embedding weight per token (q, k, v,
    o and the gated MLP), and 4 per attended query x key pair per layer and head (q.k and the weighted v)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    per_layer = hidden_size * (2 * q_size + 2 * kv_size) + 3 * hidden_size * intermediate_size
    return 2.0 * num_layers * per_layer, 4.0 * num_layers * num_heads * head_dim


@dataclass
class StepTimeModel:
    """Learns decode_s and the prefill's seconds from measured steps; says how much prefill a step may take."""

    token_weight: float
    attention_weight: float
    decode_s: float | None = None
    """Seconds of a step's decode part (None until a decode-only step was measured)."""
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    """Decayed sums over prefill samples (per-unit seconds z at attention share f): weight, f, f^2, z, f*z."""

    @property
    def measured(self) -> bool:
        """A step with a prompt chunk was measured: costs are seconds (before, units)."""
        return self._sums[0] > 0

    def _fit(self) -> tuple[float, float]:
        """(seconds per token unit alpha, seconds per attention unit beta): per-unit seconds z = alpha + (beta -
        alpha) f by weighted least squares, the slope held toward (PRIOR_ATTENTION_RATIO - 1) alpha by RIDGE."""
        w, sf, sff, sz, sfz = self._sums
        mean_f, mean_z = sf / w, sz / w
        cov, var, extra = sfz / w - mean_f * mean_z, max(sff / w - mean_f * mean_f, 0.0), PRIOR_ATTENTION_RATIO - 1
        slope = (cov + RIDGE * extra * mean_z) / (var + RIDGE + RIDGE * extra * mean_f)  # alpha substituted in
        alpha = mean_z - slope * mean_f
        floor = 0.5 * mean_z  # an extrapolated fit never makes either kind of work cost under half the mean
        return max(alpha, floor), max(alpha + slope, floor)

    def units(self, start: int, count: int, window: int | None = None) -> float:
        """Prefill units of ``count`` prompt tokens from position ``start``."""
        return count * self.token_weight + attended_positions(start, count, window) * self.attention_weight

    def cost(self, start: int, count: int, window: int | None = None) -> float:
        """What ``count`` prompt tokens from position ``start`` cost: estimated seconds once measured, else units."""
        if not self.measured:
            return self.units(start, count, window)
        per_token, per_pair = self._fit()
        return (count * self.token_weight * per_token
                + attended_positions(start, count, window) * self.attention_weight * per_pair)

    def token_s(self) -> float:
        """Estimated seconds of one prompt token's work outside attention (0.0 before a measurement)."""
        return self.token_weight * self._fit()[0] if self.measured else 0.0

    def pair_s(self) -> float:
        """Estimated seconds of one attended query x key pair (0.0 before a measurement)."""
        return self.attention_weight * self._fit()[1] if self.measured else 0.0

    def prefill_budget(self, target_s: float) -> float:
        """The cost the prompt chunks of a step that also decodes may take: max(target - decode_s, decode_s)
        seconds (a heavy decode load at most doubles its steps' time, and prompts still progress); before any
        measurement, the units of UNMEASURED_CHUNK_TOKENS tokens from position 0."""
        if not self.measured:
            return self.units(0, UNMEASURED_CHUNK_TOKENS)
        decode = self.decode_s or 0.0
        return max(target_s - decode, decode)

    def estimate(self, prefill_cost: float, decodes: bool) -> float:
        """Estimated seconds of a step whose chunks cost ``prefill_cost`` (0.0 for a part not measured yet)."""
        decode = (self.decode_s or 0.0) if decodes else 0.0
        return decode + (prefill_cost if self.measured else 0.0)

    def observe(self, prefill_tokens: int, prefill_pairs: int, decodes: bool, seconds: float) -> None:
        """Learn from one executed step: its prompt tokens and their attended pairs, whether it decoded, its wall
        time."""
        if prefill_tokens == 0:
            if decodes:
                old = self.decode_s
                rate = DECODE_RISE if old is None or seconds > old else DECODE_FALL
                self.decode_s = seconds if old is None else old + rate * (seconds - old)
            return
        work, attention = prefill_tokens * self.token_weight, prefill_pairs * self.attention_weight
        if prefill_tokens < MIN_SAMPLE_TOKENS or work + attention <= 0:
            return
        rest = seconds - ((self.decode_s or 0.0) if decodes else 0.0)
        if rest <= 0:  # noise can make a step faster than its decodes alone: no sample then
            return
        f, z = attention / (work + attention), rest / (work + attention)
        self._sums = [DECAY * old + new for old, new in zip(self._sums, (1.0, f, f * f, z, f * z))]
