"""Bidirectional (non-causal) attention over a flat, unpadded batch of whole sequences, for encoder-only models
(BERT-style embedders and cross-encoders): no KV cache, no block tables, every token attends to every token of
its own sequence. ``EncoderAttention`` is the layers' op: the compiled kernel (csrc/encoder.cpp) where the CPU
has one, else ``bidirectional_attention``, torch's SDPA over length buckets, whose measurements follow.

Measured on 2 Xeon cores (AVX512-BF16/AMX), torch 2.13's SDPA, tcmalloc, best of several runs, ms float32 /
bfloat16; each batch with 12 heads of 32 (MiniLM), then 12 heads of 64 (BERT-base):

    batch             one SDPA per seq   one padded SDPA   this module
    500 x 5..128 tok      81 / 67            159 / 87          77 / 60
                         116 / 82            260 / 147        115 / 74
    500 x 5..24           18 / 21             19 / 12          11 / 11
                          25 / 23             43 / 21          23 / 15
    256 x 8..32           11 / 12            7.9 / 6.0        7.3 / 6.4
                          15 / 13             21 / 11          15 / 8.6
    100 x 16..64         7.6 / 7.3           8.9 / 5.0        6.1 / 4.4
                          11 / 8.9            18 / 7.8         11 / 6.3
    8 x 200..512          12 / 7.2            20 / 11          12 / 7.3
                          19 / 9.4            32 / 13          21 / 8.6
    1 x 512              2.0 / 1.1           1.9 / 1.1        1.9 / 1.1
                         3.4 / 1.3           3.4 / 1.2        3.3 / 1.2

A padded batch pays for its padding twice: in the attention and in the gathers that build it and scatter its
output back (copies of q, k, v and the output at the padded size; a big padded buffer is also fresh memory that
glibc's allocator page-faults in: 4x slower copies at 256 x 32 x 768 float32). So one SDPA per sequence wins for
mixed lengths; what it loses is a fixed ~25 us per call, most of a short sequence's work. Hence: short sequences
go in small padded buckets of similar length, the rest one by one. (Buckets without the limits below: 111 / 80
and 244 / 123 ms for the first batch, without tcmalloc. A block-diagonal mask over the whole flat batch in one
SDPA: 250+ ms for 32 x 64 tokens, quadratic in the batch.)
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from pagedllm.layers.custom_op import CustomOp

BATCHED_UP_TO = 64
"""Sequences up to this long are padded into buckets with others (a call's overhead outweighs their attention);
longer ones run alone (their padding would cost more than the call)."""
BUCKET_RATIO = 0.8
"""A bucket's shortest sequence is at least this fraction of its longest (bounds the padding waste)..."""
SHORT = 32
"""... except in a bucket of sequences up to this long, which takes any shorter one (little to waste)."""
PAD_MULTIPLE = 16
"""A masked bucket is padded to a multiple of this many tokens: SDPA's CPU kernel runs whole 16-row blocks fast and
ragged tails slowly (85 sequences of 24 tokens: 1.65 ms; of 32: 1.22 ms; of 31: 2.72 ms, float32)."""
BUCKET_ROWS = 2048
"""Padded tokens per bucket at most: small buffers stay in memory the allocator reuses (256 x 8..32 tokens of
768 float32 lanes: 12 ms in buckets of 2,048, 44 ms in one)."""


KERNEL_UP_TO = 96
"""With the compiled kernel, sequences up to this long go to it, longer ones to one SDPA call each: past ~100
tokens torch's SDPA (oneDNN's blocked GEMMs, AMX tiles for bfloat16 where the CPU has them) runs a sequence faster
than the kernel's vector FMAs, while below it the kernel saves SDPA's per-call cost and the bucketing's copies.
Measured on 2 Xeon cores (AMX), 12 heads of 32, ~4,096 tokens of one length, kernel / torch ms, float32 then
bfloat16: 16 tokens 2.1 / 4.1 and 1.7 / 4.1; 64: 4.6 / 5.9 and 3.2 / 4.0; 96: 6.3 / 6.5 and 4.7 / 4.6; 128: 9.2 /
8.5 and 6.1 / 4.8; 384: 21 / 13 and 17 / 7.0. A windowed layer runs every sequence in the kernel (its band costs
the kernel O(length x window); SDPA pays for the whole masked square)."""
AMX_KERNEL_UP_TO = 256
"""The same for bfloat16 on AMX tiles (the "amx" level): 16 tokens 1.4 ms against SDPA's 4.0; 64: 1.7 / 3.9; 128:
2.9 / 4.5; 256: 5.1 / 6.1; 384: 6.8 / 6.5."""


class EncoderAttention(CustomOp):
    """Bidirectional attention of an encoder layer: ``forward(q, k, v, seq_lens)``, q, k, v (tokens, heads,
    head_dim) of whole sequences one after the other -> (tokens, heads, head_dim). ``forward_cpu`` is the compiled
    kernel (``pl_encoder_attention``: q, k, v read in place, no padding; bfloat16 on AMX tiles at the "amx" level;
    long sequences to SDPA, see ``KERNEL_UP_TO``); ``forward_native`` is ``bidirectional_attention`` (torch's SDPA
    over length buckets)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, window: int | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.num_heads, self.head_dim, self.scale, self.window = num_heads, head_dim, scale, window
        super().__init__(dtype)

    def kernels_suit(self) -> bool:
        return self.head_dim % 32 == 0  # the kernel's tiles hold 32 dims

    def forward_native(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        return bidirectional_attention(q, k, v, seq_lens, self.scale, self.window)

    def forward_cpu(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        assert self.kernels is not None and q.shape[0] == sum(seq_lens), (q.shape, sum(seq_lens))
        starts = list(itertools.accumulate(seq_lens, initial=0))
        tiles = self.kernels.amx and q.dtype == torch.bfloat16 and self.head_dim <= 128  # the AMX path's reach
        longest = 0 if self.window is not None else AMX_KERNEL_UP_TO if tiles else KERNEL_UP_TO
        out = self.kernels.encoder_attention(q, k, v, torch.tensor(starts, dtype=torch.int32), self.scale,
                                             self.window, longest)
        if longest:
            for i, n in enumerate(seq_lens):
                if n > longest:
                    s, e = starts[i], starts[i + 1]
                    out[s:e] = _alone(q[s:e], k[s:e], v[s:e], self.scale)
        return out


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
                            scale: float, window: int | None = None) -> torch.Tensor:
    """q, k, v (tokens, heads, head_dim), the sequences of ``seq_lens`` one after the other -> (tokens, heads,
    head_dim): each token's attention over all tokens of its sequence, or with ``window`` only over those at most
    ``window`` positions before or after it (ModernBERT's local layers). Any float dtype SDPA takes."""
    assert q.shape[0] == sum(seq_lens), (q.shape, sum(seq_lens))
    if len(seq_lens) == 1:
        return _alone(q, k, v, scale, window)
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])  # (tokens, heads, head_dim)
    for bucket in _buckets(seq_lens):
        if len(bucket) == 1:
            s, e = starts[bucket[0]], starts[bucket[0] + 1]
            out[s:e] = _alone(q[s:e], k[s:e], v[s:e], scale, window)
        else:
            _padded(q, k, v, [seq_lens[i] for i in bucket], [starts[i] for i in bucket], scale, out, window)
    return out


def _alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           window: int | None = None) -> torch.Tensor:
    """One sequence's (len, heads, head_dim) q, k, v -> its output (len, heads, head_dim)."""
    n = q.shape[0]
    mask = None
    if window is not None and n > window + 1:  # shorter: every pair is within the window
        i = torch.arange(n, device=q.device)
        mask = (i.unsqueeze(1) - i).abs() <= window  # (len, len), True: attend
    # (len, heads, d) -> (1, heads, len, d): a strided view, which SDPA's CPU kernel reads without a copy
    out = F.scaled_dot_product_attention(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2),
                                         v.unsqueeze(0).transpose(1, 2), attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)  # (len, heads, d)


def _padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], starts: list[int], scale: float,
            out: torch.Tensor, window: int | None = None) -> None:
    """The sequences of ``lens`` (longest first) starting at rows ``starts`` in one padded SDPA, written into
    ``out``. Padding repeats a sequence's last token and is masked out of the keys (its own rows are dropped).
    With ``window``, a band over it too."""
    device, b, longest = q.device, len(lens), lens[0]
    width = longest if lens[-1] == longest else -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE
    length = torch.tensor(lens, device=device)
    first = torch.tensor(starts, device=device)
    j = torch.arange(width, device=device)
    valid = j < length.unsqueeze(1)  # (b, width)
    gather = (first.unsqueeze(1) + torch.minimum(j, length.unsqueeze(1) - 1)).reshape(-1)  # (b * width,)

    def pad(x: torch.Tensor) -> torch.Tensor:
        # (b * width, heads, d) -> (b, width, heads, d) -> (b, heads, width, d)
        return x.index_select(0, gather).view(b, width, *x.shape[1:]).transpose(1, 2)

    mask = None if width == lens[-1] else valid.view(b, 1, 1, width)  # keys only: padded queries stay finite
    if window is not None and longest > window + 1:
        # a padded query stands where its sequence's last token is: it keeps at least that key (finite rows)
        at = torch.minimum(j, length.unsqueeze(1) - 1)  # (b, width) each query's position
        band = (at.unsqueeze(2) - j).abs() <= window  # (b, width, width)
        mask = (band & valid.unsqueeze(1)).unsqueeze(1)  # (b, 1, width, width)
    padded = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, scale=scale)
    rows = padded.transpose(1, 2).reshape(b * width, *out.shape[1:])  # (b * width, heads, d)
    keep = (torch.arange(b, device=device).unsqueeze(1) * width + j)[valid]  # padded rows of real tokens
    out.index_copy_(0, (first.unsqueeze(1) + j)[valid], rows.index_select(0, keep))


def _buckets(seq_lens: list[int]) -> list[list[int]]:
    """Sequence indices grouped for ``_padded`` (each group longest first); a long sequence is a group alone."""
    buckets: list[list[int]] = []
    for i in sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i]):
        head = seq_lens[buckets[-1][0]] if buckets else 0
        if buckets and head <= BATCHED_UP_TO and (len(buckets[-1]) + 1) * head <= BUCKET_ROWS and (
                head <= SHORT or seq_lens[i] >= BUCKET_RATIO * head):
            buckets[-1].append(i)
        else:
            buckets.append([i])
    return buckets
