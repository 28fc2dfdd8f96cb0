"""Gumbel-max text watermarking (vLLM's --watermark-config {"algorithm": "gumbel", "key": K}).

A watermarked row does not draw its token at random: it takes

    argmax_v  logits'[v] + g(K, context, v),    g = -log(-log u(K, context, v))

where logits' are the row's processed logits (penalties, bias, temperature, min_p, top_k / top_p: what the
ordinary draw samples from), and u(K, context, v) in (0, 1) is a keyed pseudo-random function of the secret key,
the ``context_width`` tokens generated last (a position before the first generated token counts as -1) and the
candidate token. Over random keys this is exactly a sample of softmax(logits') (the Gumbel-max trick), so the text
reads as ordinary sampling; with the key, a detector can recompute u for each written token and find it
improbably high. Greedy rows (temperature 0) and requests that opt out (``watermarking: false``) are sampled as
usual, and so is a row whose context already occurred earlier in the reply (``deduplicate_contexts``): a repeated
context would repeat its choice, which feeds loops.

u is Philox4x32-10 (Salmon et al., SC'11, the Random123 constants) on integer tensors, the same bits on any
device: the 64-bit key and the context are hashed (BLAKE2b, 20 bytes) into Philox's two key words and counter
words 1 to 3; candidate token v's block v // 4 is counter word 0, and output word v % 4 of that block, w, gives
u = ((w >> 8) + 1) / (2^24 + 1) (one Philox call serves four tokens).
"""
from __future__ import annotations

import hashlib
import struct
from collections import Counter
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.config import WatermarkConfig
    from pagedllm.worker.input_batch import CachedRequestState

_MASK = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
ROUNDS = 10


def _mulhilo(m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of m * x for x int64 holding uint32 values: x split in 16-bit halves so that no
    product leaves int64."""
    a = (x >> 16) * m  # (< 2^48)
    b = (x & 0xFFFF) * m  # (< 2^48)
    high = (a + (b >> 16)) >> 16
    low = (((a & 0xFFFF) << 16) + b) & _MASK
    return high, low


def philox4x32(counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
               key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 of counters (four int64 tensors of uint32 words, broadcastable) under a 2-word key."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for i in range(ROUNDS):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        if i != ROUNDS - 1:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
    return c0, c1, c2, c3


def keyed_uniforms(key: int, context: list[int], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(vocab_size,) float32 u(key, context, v) in (0, 1) for every token v (module docstring)."""
    words = b"".join(struct.pack("<I", t & _MASK) for t in context)
    digest = hashlib.blake2b(key.to_bytes(8, "little") + words, digest_size=20).digest()
    k0, k1, c1, c2, c3 = struct.unpack("<5I", digest)
    blocks = torch.arange(-(-vocab_size // 4), dtype=torch.int64, device=device)  # token v: block v // 4
    fixed = [torch.full_like(blocks[:1], c) for c in (c1, c2, c3)]
    words = torch.stack(philox4x32((blocks, *fixed), (k0, k1)), dim=-1).flatten()[:vocab_size]  # word v % 4
    return (((words >> 8).to(torch.float64) + 1.0) / (2 ** 24 + 1)).to(torch.float32)


def gumbel_noise(key: int, context: list[int], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(vocab_size,) float32 -log(-log u): the noise the watermarked argmax adds to a row's processed logits."""
    u = keyed_uniforms(key, context, vocab_size, device)
    return -torch.log(-torch.log(u))


class _SeenContexts:
    """The contexts that preceded each position of one request's searched history (its tokens from ``base`` on),
    counted over the window of positions [evicted, added): position i's context is the ``width`` tokens before
    it, -1 before the history's start."""

    def __init__(self, width: int, base: int) -> None:
        self.width, self.base = width, base
        self.counts: Counter[tuple[int, ...]] = Counter()
        self.added = self.evicted = 0
        self.last: int | None = None
        """The history's token at position added - 1 when it was counted: a history rewritten under it (shorter,
        or another token there) is counted again from scratch."""

    def extends(self, tokens: list[int], base: int) -> bool:
        """Whether ``tokens`` (from ``base``) still begins with the history counted so far."""
        n = len(tokens) - base
        return base == self.base and self.added <= n and (self.added == 0 or tokens[base + self.added - 1] == self.last)

    def _context(self, tokens: list[int], i: int) -> tuple[int, ...]:
        start = self.base + i - self.width
        pad = max(0, -(i - self.width))
        return (-1,) * pad + tuple(tokens[start + pad:self.base + i])

    def advance(self, tokens: list[int], max_history: int | None) -> None:
        """Count the positions added since the last call, and drop those past the last ``max_history``."""
        n = len(tokens) - self.base
        first = 0 if max_history is None else max(0, n - max_history)
        for i in range(self.evicted, min(first, self.added)):
            key = self._context(tokens, i)
            self.counts[key] -= 1
            if not self.counts[key]:
                del self.counts[key]
        self.evicted = max(self.evicted, first)
        for i in range(max(self.added, first), n):
            self.counts[self._context(tokens, i)] += 1
        self.added = n
        self.last = tokens[self.base + n - 1] if n else None


class GumbelWatermark:
    """The watermark of one engine: which rows of a step are watermarked, and their noise."""

    def __init__(self, config: WatermarkConfig) -> None:
        self.key = config.key
        self.width = config.context_width
        self.scope = config.deduplicate_contexts
        self.max_history = config.deduplicate_contexts_max_history
        self.enforce = config.enforce

    def context(self, state: CachedRequestState) -> list[int]:
        """The last ``context_width`` generated tokens, -1 where the reply is shorter."""
        generated = state.output_token_ids[-self.width:]
        return [-1] * (self.width - len(generated)) + generated

    def repeated(self, state: CachedRequestState, context: list[int]) -> bool:
        """Whether this context already preceded a token of the searched history (deduplicate_contexts): such a
        row is sampled without the watermark. "all" also searches the prompt and leaves the first context_width
        generated tokens unwatermarked; the search covers the max_history most recent positions. The contexts
        seen are counted on the request's state as it grows (``_SeenContexts``): a step costs the tokens it
        added, not the whole history again."""
        if self.scope == "none":
            return False
        generated = len(state.token_ids) - state.num_prompt_tokens
        if self.scope == "all" and generated < self.width:
            return True
        base = 0 if self.scope == "all" else state.num_prompt_tokens
        seen = state.watermark_seen
        if seen is None or not seen.extends(state.token_ids, base):
            seen = state.watermark_seen = _SeenContexts(self.width, base)
        seen.advance(state.token_ids, self.max_history)
        return seen.counts.get(tuple(context), 0) > 0

    def noise(self, states: list[CachedRequestState], greedy: list[bool], vocab_size: int,
              device: torch.device) -> dict[int, torch.Tensor]:
        """Row -> (vocab_size,) Gumbel noise of each watermarked row (sampling, not opted out, context new)."""
        out = {}
        for row, (state, is_greedy) in enumerate(zip(states, greedy)):
            if is_greedy or not (state.sampling_params.watermarking or self.enforce):
                continue
            context = self.context(state)
            if not self.repeated(state, context):
                out[row] = gumbel_noise(self.key, context, vocab_size, device)
        return out

