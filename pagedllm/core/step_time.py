"""The estimated time of an engine step, learned from measured ones (SchedulerConfig.step_time_target).

A step's prefill part (its prompt chunks) costs ``tokens * token_weight + attended_pairs * attention_weight``
units: model FLOPs-like weights the engine core derives from the model's shape (``cost_weights``). Its decode
part costs ``decode_s`` seconds. Measured step times teach two numbers, each a moving average:

- ``decode_s``: the time of steps that only decode;
- ``s_per_unit``: (a step's time - decode_s when it also decoded) / its prefill units, over steps with a prompt
  chunk of at least MIN_SAMPLE_TOKENS tokens (a smaller one's time is mostly the step's fixed cost).

Pure Python, no clock: it is given the measurements, so the scheduler's tests are exact.
"""
from __future__ import annotations

from dataclasses import dataclass


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
"""Fewest prompt tokens in a step whose time teaches s_per_unit."""
RISE, FALL = 0.5, 0.2
"""Weights of a new sample in the moving averages when it is above / below the estimate: a slow step is believed
at once (too small a chunk costs little, too big a one is the gap this bounds)."""


def cost_weights(hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> tuple[float, float]:
    """(token_weight, attention_weight) of a dense decoder: 2 FLOPs per non-embedding weight per token (q, k, v,
    o and the gated MLP), and 4 per attended query x key pair per layer and head (q.k and the weighted v)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    per_layer = hidden_size * (2 * q_size + 2 * kv_size) + 3 * hidden_size * intermediate_size
    return 2.0 * num_layers * per_layer, 4.0 * num_layers * num_heads * head_dim


def _ema(old: float | None, sample: float) -> float:
    if old is None:
        return sample
    return old + (RISE if sample > old else FALL) * (sample - old)


@dataclass
class StepTimeModel:
    """Learns decode_s and s_per_unit from measured steps; says how many prefill units a step may take."""

    token_weight: float
    attention_weight: float
    decode_s: float | None = None
    """Seconds of a step's decode part (None until a decode-only step was measured)."""
    s_per_unit: float | None = None
    """Seconds per prefill unit (None until a step with a prompt chunk was measured)."""

    def units(self, start: int, count: int, window: int | None = None) -> float:
        """Prefill units of ``count`` prompt tokens from position ``start``."""
        return count * self.token_weight + attended_positions(start, count, window) * self.attention_weight

    def prefill_budget(self, target_s: float) -> float:
        """Units the prompt chunks of a step that also decodes may take: max(target - decode_s, decode_s) seconds
        (a heavy decode load at most doubles its steps' time, and prompts still progress)."""
        if self.s_per_unit is None:
            return self.units(0, UNMEASURED_CHUNK_TOKENS)
        decode = self.decode_s or 0.0
        return max(target_s - decode, decode) / self.s_per_unit

    def estimate(self, prefill_units: float, decodes: bool) -> float:
        """Estimated seconds of a step (0.0 for a part not measured yet)."""
        decode = (self.decode_s or 0.0) if decodes else 0.0
        return decode + prefill_units * (self.s_per_unit or 0.0)

    def observe(self, prefill_tokens: int, prefill_units: float, decodes: bool, seconds: float) -> None:
        """Learn from one executed step: its prompt tokens and their units, whether it decoded, its wall time."""
        if prefill_tokens == 0:
            if decodes:
                self.decode_s = _ema(self.decode_s, seconds)
            return
        if prefill_tokens < MIN_SAMPLE_TOKENS or prefill_units <= 0:
            return
        rest = seconds - ((self.decode_s or 0.0) if decodes else 0.0)
        if rest > 0:  # noise can make a step faster than its decodes alone: no sample then
            self.s_per_unit = _ema(self.s_per_unit, rest / prefill_units)
