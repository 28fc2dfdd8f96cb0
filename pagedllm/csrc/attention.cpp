// Paged attention for rows of one query each, reading K/V in place from the block-structured
// cache: no gathered copy of the context, no padding to the longest sequence. A row is a decode
// token, or one token of a prompt chunk with the length of its causal prefix (the Python side
// gives every row its own block table and length). K/V slot writes live here too.
//
// Work items are (row, KV head) pairs, split between threads by total context length (a few long
// rows do not leave one thread idle). The query heads sharing a KV head are handled together so
// each K/V row is read once. Scores are float32: one pass over K, a softmax, one pass over V.
// When the items are too few for the threads (batch 1: as many as KV heads) and long, they are cut
// into pieces of whole KV blocks that threads run apart (split-KV, attention.h's plan_split): a
// piece keeps its max score, sum of exp and unnormalized float32 output, merged afterwards by
// log-sum-exp rescaling, so a 32k context does not leave cores idle. Every path below computes a
// whole task or a piece alike (a piece is a shorter window, its output the partial result). The rows
// of a prompt chunk are grouped into tiles that read each K/V block once for many rows (see "prompt
// tiles" below).
//
// Cache layout per block and KV head: V as (block_size, head_dim) rows; K pair-interleaved as
// (head_dim / 2, block_size, 2): dims (2p, 2p + 1) of every slot side by side (write_kv stores it
// so). One load then holds dims 2p and 2p + 1 of a run of tokens: bf16 words split into the two
// dims' float32 lanes with a shift and a mask, float / f16 lanes are de-interleaved; either way
// the scores of a run of tokens grow by two FMAs against broadcast q values, with no horizontal
// sums (5-8% faster per layer than token rows reduced by transposes, measured at AVX512-BF16).
//
// Paths, for head_dim 64 or 128 and blocks of a multiple of the vector width:
// - bf16 on AVX512-BF16: q.k with vdpbf16ps on the stored bf16 pairs (decode_task_dot);
// - every level and storage type: the FMA path (decode_task_fma), float32 arithmetic;
// and any other shape a scalar loop (task_scalar). The K block two ahead and the V block of the
// same tokens are prefetched while one is read (random block order defeats the hardware
// prefetcher at every block boundary; 256 x 330 tokens: 1.65 ms per layer against 1.98 one
// ahead, 4.1 before), as are the next task's first K blocks.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include "amx.h"
#include "attention.h"

namespace {
using namespace pl;

// This KV head's slots of the i-th block of a row's table (one contiguous run of bs * D values).
template <typename T>
inline const T* head_block(const T* cache, const int32_t* table, int64_t i, int64_t block_stride, int64_t head_off) {
  return cache + static_cast<int64_t>(table[i]) * block_stride + head_off;
}

// ------------------------------------------------------------------ scalar path (any shape)

// One task (or piece, w its window) on any shape: out its group x D output rows, or with `part` the
// piece's partial result (see attention.h) instead.
template <typename T>
void task_scalar(const T* q, const T* kc, const T* vc, const Window& w, int64_t head_off, const Shape& s, T* out,
                 float* part, Scratch& sc) {
  const int64_t D = s.D, bs = s.bs, group = s.group, len = w.len;
  sc.qf.resize(group * D);
  sc.acc.resize(group * D);
  sc.kbuf.resize(bs * D);
  for (int64_t i = 0; i < group * D; ++i) sc.qf[i] = to_f32(q[i]) * s.scale;
  sc.scores.resize(group * len);
  float* scores = sc.scores.data();
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min<int64_t>(bs, len - t0);
    const T* base = head_block(kc, w.table, t0 / bs, s.block_stride, head_off);
    for (int64_t o = 0; o < n; ++o)  // K is stored pair-interleaved: gather token rows
      for (int64_t d = 0; d < D; ++d) sc.kbuf[o * D + d] = to_f32(base[((d >> 1) * bs + o) * 2 + (d & 1)]);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t o = 0; o < n; ++o) {
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += sc.qf[g * D + d] * sc.kbuf[o * D + d];
        scores[g * len + t0 + o] = dot;
      }
  }
  finish_scores(scores, group, len, w.masked, s.softcap);
  if (part) exp_rows(scores, group, len, part, D);
  else softmax_rows(scores, group, len);
  std::fill(sc.acc.begin(), sc.acc.end(), 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min<int64_t>(bs, len - t0);
    const T* base = head_block(vc, w.table, t0 / bs, s.block_stride, head_off);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t o = 0; o < n; ++o) {
        const float p = scores[g * len + t0 + o];
        for (int64_t d = 0; d < D; ++d) sc.acc[g * D + d] += p * to_f32(base[o * D + d]);
      }
  }
  for (int64_t i = 0; i < group * D; ++i)
    if (part) part[i] = sc.acc[i];
    else out[i] = from_f32<T>(sc.acc[i]);
}

// ------------------------------------------------------------------ FMA path (every level)
// Dims 2p and 2p + 1 of kLanes tokens from a pair-interleaved run (2 * kLanes values), in order.
inline void k_pairs(const bf16* p, V& even, V& odd) { vload_split(p, even, odd); }
template <typename T>
inline void k_pairs(const T* p, V& even, V& odd) {
  vdeinterleave(vload(p), vload(p + kLanes), even, odd);
}

#ifdef PL_AVX512
constexpr int kSubs = 4;        // runs of kLanes tokens per q.k iteration: 4 x 4 accumulators of 32 registers
constexpr int kAccRegs = 16;    // P.V accumulators per pass
constexpr int kPassDims = 128;  // P.V dims per pass (a whole head of 64 or 128)
#else
constexpr int kSubs = 2;       // 4 x 2 accumulators + 4 loaded + 2 broadcast of 16 registers
constexpr int kAccRegs = 12;   // 3 heads x 32 dims (+ 2 loaded, 1 broadcast): a GQA group of 3 reads its V
constexpr int kPassDims = 32;  // rows twice (two halves of 64 dims), not once per head with 8 sums each
                               // (256 x 190 tokens, bf16, 30 layers' caches: 87.6 -> 82.6 ms, A/B in one process)
#endif

template <int kDim, int kG, int kS, typename T>
inline void qk_tile(const float* q, const T* const* runs, int64_t bs, V (*out)[kSubs]) {
  V acc[kG][kS];
  for (int g = 0; g < kG; ++g)
    for (int j = 0; j < kS; ++j) acc[g][j] = vzero();
  for (int p = 0; p < kDim / 2; ++p) {
    V e[kS], o[kS];
    for (int j = 0; j < kS; ++j) k_pairs(runs[j] + p * bs * 2, e[j], o[j]);
    for (int g = 0; g < kG; ++g) {
      const V qe = vset1(q[g * kDim + 2 * p]), qo = vset1(q[g * kDim + 2 * p + 1]);
      for (int j = 0; j < kS; ++j) acc[g][j] = vfma(qo, o[j], vfma(qe, e[j], acc[g][j]));
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int j = 0; j < kS; ++j) out[g][j] = acc[g][j];
}

template <int kDim, int kS, typename T>
inline void qk_heads(const float* q, const T* const* runs, int64_t bs, int64_t heads, V (*out)[kSubs]) {
  switch (heads) {
    case 1: qk_tile<kDim, 1, kS>(q, runs, bs, out); break;
    case 2: qk_tile<kDim, 2, kS>(q, runs, bs, out); break;
    case 3: qk_tile<kDim, 3, kS>(q, runs, bs, out); break;
    default: qk_tile<kDim, 4, kS>(q, runs, bs, out); break;
  }
}

// scores[g * len + t] = scale * q_g . k_t for the task's `group` heads (q: group x kDim float32).
template <int kDim, typename T>
void qk_fma(const float* q, const T* kc, const T* vc, const int32_t* table, int64_t len, int64_t group, const Shape& s,
            int64_t head_off, float* scores) {
  constexpr int64_t kRun = kSubs * kLanes;
  const int64_t bs = s.bs, block_bytes = bs * kDim * sizeof(T);
  int64_t next_fetch = 0;  // first block not yet prefetched
  for (int64_t t0 = 0; t0 < len; t0 += kRun) {
    const int64_t n = std::min<int64_t>(kRun, len - t0), subs = (n + kLanes - 1) / kLanes;
    // K two blocks ahead, V of these tokens
    for (; next_fetch * bs < std::min(len, t0 + kRun + 2 * bs); ++next_fetch) {
      prefetch_bytes(head_block(kc, table, next_fetch, s.block_stride, head_off), block_bytes);
      prefetch_bytes(head_block(vc, table, next_fetch, s.block_stride, head_off), block_bytes);
    }
    const T* runs[kSubs];
    for (int64_t j = 0; j < subs; ++j) {
      const int64_t t = t0 + kLanes * j;
      runs[j] = head_block(kc, table, t / bs, s.block_stride, head_off) + (t % bs) * 2;
    }
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      V sc[4][kSubs];
      const int64_t heads = std::min<int64_t>(4, group - g0);
      switch (subs) {
        case 1: qk_heads<kDim, 1>(q + g0 * kDim, runs, bs, heads, sc); break;
#ifdef PL_AVX512
        case 2: qk_heads<kDim, 2>(q + g0 * kDim, runs, bs, heads, sc); break;
        case 3: qk_heads<kDim, 3>(q + g0 * kDim, runs, bs, heads, sc); break;
#endif
        default: qk_heads<kDim, kSubs>(q + g0 * kDim, runs, bs, heads, sc); break;
      }
      for (int64_t g = g0; g < g0 + heads; ++g)
        for (int64_t j = 0; j < subs; ++j) {
          const int64_t left = n - kLanes * j;
          const V v = vmul(sc[g - g0][j], vset1(s.scale));
          if (left >= kLanes) vstore(scores + g * len + t0 + kLanes * j, v);
          else vstore_n(scores + g * len + t0 + kLanes * j, v, static_cast<int>(left));
        }
    }
  }
}

// out_g[dims d0 .. d0 + kW) = sum_t p[g * len + t] * v_t for kG heads, float32 sums in registers; out
// in the storage type (a whole task) or float32 (a piece's partial result).
template <int kDim, int kW, int kG, typename T, typename O>
void pv_slice(const float* p, const T* vc, const int32_t* table, int64_t len, const Shape& s, int64_t head_off,
              int64_t d0, O* out) {
  constexpr int kVec = kW / kLanes;
  constexpr bool kSplit = std::is_same<T, bf16>::value;  // bf16: accumulators hold even / odd dims
  V acc[kG][kVec];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kVec; ++c) acc[g][c] = vzero();
  const int64_t bs = s.bs, block_bytes = bs * kDim * sizeof(T);
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min<int64_t>(bs, len - t0);
    const T* base = head_block(vc, table, t0 / bs, s.block_stride, head_off) + d0;
    // again, though the K pass asked for these blocks: long contexts outgrow L1 (measured: dropping it is slower)
    if (d0 == 0 && t0 + 2 * bs < len)
      prefetch_bytes(head_block(vc, table, t0 / bs + 2, s.block_stride, head_off), block_bytes);
    for (int64_t o = 0; o < n; ++o) {
      const float* po = p + t0 + o;
      // two vectors at a time, used by every head at once: few registers live besides the sums
      for (int c = 0; c < kVec; c += 2) {
        V v0, v1;
        if constexpr (kSplit) {
          vload_split(base + o * kDim + c * kLanes, v0, v1);
        } else {
          v0 = vload(base + o * kDim + c * kLanes);
          v1 = vload(base + o * kDim + (c + 1) * kLanes);
        }
        for (int g = 0; g < kG; ++g) {
          const V w = vset1(po[g * len]);
          acc[g][c] = vfma(w, v0, acc[g][c]);
          acc[g][c + 1] = vfma(w, v1, acc[g][c + 1]);
        }
      }
    }
  }
  for (int g = 0; g < kG; ++g) {
    O* dst = out + g * kDim + d0;
    if constexpr (kSplit) {
      for (int c = 0; c < kVec / 2; ++c) {
        V lo, hi;
        vinterleave(acc[g][2 * c], acc[g][2 * c + 1], lo, hi);
        vstore(dst + c * 2 * kLanes, lo);
        vstore(dst + c * 2 * kLanes + kLanes, hi);
      }
    } else {
      for (int c = 0; c < kVec; ++c) vstore(dst + c * kLanes, acc[g][c]);
    }
  }
}

// P.V for the task's `group` heads, kMaxG heads per pass over V (kW dims at a time).
template <int kDim, int kW, int kMaxG, typename T, typename O>
void pv_heads(const float* scores, const T* vc, const int32_t* table, int64_t len, const Shape& s, int64_t head_off,
              O* out) {
  for (int64_t d0 = 0; d0 < kDim; d0 += kW)
    for (int64_t g0 = 0; g0 < s.group; g0 += kMaxG) {
      const float* p = scores + g0 * len;
      O* o = out + g0 * kDim;
      switch (std::min<int64_t>(kMaxG, s.group - g0)) {
        case 1: pv_slice<kDim, kW, 1>(p, vc, table, len, s, head_off, d0, o); break;
        case 2: pv_slice<kDim, kW, (kMaxG >= 2 ? 2 : 1)>(p, vc, table, len, s, head_off, d0, o); break;
        case 3: pv_slice<kDim, kW, (kMaxG >= 3 ? 3 : 1)>(p, vc, table, len, s, head_off, d0, o); break;
        default: pv_slice<kDim, kW, (kMaxG >= 4 ? 4 : 1)>(p, vc, table, len, s, head_off, d0, o); break;
      }
    }
}

// One task (or piece: w its window) on the FMA path: out its output rows, or with `part` its partial result.
template <int kDim, typename T>
void decode_task_fma(const T* q, const T* kc, const T* vc, const Window& w, const Shape& s, int64_t head_off, T* out,
                     float* part, Scratch& sc) {
  const int64_t group = s.group, len = w.len;
  sc.qf.resize(group * kDim);
  for (int64_t i = 0; i < group * kDim; ++i) sc.qf[i] = to_f32(q[i]);
  sc.scores.resize(group * len);
  float* scores = sc.scores.data();
  qk_fma<kDim, T>(sc.qf.data(), kc, vc, w.table, len, group, s, head_off, scores);
  finish_scores(scores, group, len, w.masked, s.softcap);
  constexpr int kW = kDim < kPassDims ? kDim : kPassDims;
  constexpr int kMaxG = std::max(1, kAccRegs / (kW / kLanes));
  if (part) {
    exp_rows(scores, group, len, part, kDim);
    pv_heads<kDim, kW, kMaxG>(scores, vc, w.table, len, s, head_off, part);
  } else {
    softmax_rows(scores, group, len);
    pv_heads<kDim, kW, kMaxG>(scores, vc, w.table, len, s, head_off, out);
  }
}

#ifdef __AVX512BF16__
// ------------------------------------------------------------------ vdpbf16ps path (bf16, AVX512-BF16)
// One 512-bit load holds dims (2p, 2p+1) of 16 tokens and vdpbf16ps against a broadcast q pair
// adds that pair's products to 16 tokens' scores at once. kSub runs of 16 tokens share each
// broadcast (kG * kSub independent accumulators).
template <int kDim, int kG, int kSub>
inline void dot_tile(const bf16* q, const bf16* const* runs, int64_t bs, __m512 (*out)[4]) {
  __m512 acc[kG][kSub];
  for (int g = 0; g < kG; ++g)
    for (int j = 0; j < kSub; ++j) acc[g][j] = _mm512_setzero_ps();
  const int32_t* qp = reinterpret_cast<const int32_t*>(q);
#pragma GCC unroll 4
  for (int p = 0; p < kDim / 2; ++p) {
    __m512bh kv[kSub];
    for (int j = 0; j < kSub; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(runs[j] + p * bs * 2);
    for (int g = 0; g < kG; ++g) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(qp[g * kDim / 2 + p]);
      for (int j = 0; j < kSub; ++j) acc[g][j] = _mm512_dpbf16_ps(acc[g][j], qb, kv[j]);
    }
  }
  for (int g = 0; g < kG; ++g)
    for (int j = 0; j < kSub; ++j) out[g][j] = acc[g][j];
}

template <int kDim, int kSub>
inline void dot_heads(const bf16* q, const bf16* const* runs, int64_t bs, int64_t group, int64_t g0, __m512 (*out)[4]) {
  switch (std::min<int64_t>(4, group - g0)) {
    case 1: dot_tile<kDim, 1, kSub>(q + g0 * kDim, runs, bs, out); break;
    case 2: dot_tile<kDim, 2, kSub>(q + g0 * kDim, runs, bs, out); break;
    case 3: dot_tile<kDim, 3, kSub>(q + g0 * kDim, runs, bs, out); break;
    default: dot_tile<kDim, 4, kSub>(q + g0 * kDim, runs, bs, out); break;
  }
}

template <int kDim>
void qk_dot(const bf16* q, const bf16* kc, const bf16* vc, const int32_t* table, int64_t len, const Shape& s,
            int64_t head_off, float* scores) {
  const int64_t bs = s.bs, group = s.group, block_bytes = bs * kDim * 2;
  const __m512 vscale = _mm512_set1_ps(s.scale);
  int64_t next_fetch = 0;
  for (int64_t t0 = 0; t0 < len; t0 += 64) {
    const int64_t n = std::min<int64_t>(64, len - t0), subs = (n + 15) / 16;
    for (; next_fetch * bs < std::min(len, t0 + 64 + 2 * bs); ++next_fetch) {  // K two blocks ahead, V of these tokens
      prefetch_bytes(head_block(kc, table, next_fetch, s.block_stride, head_off), block_bytes);
      prefetch_bytes(head_block(vc, table, next_fetch, s.block_stride, head_off), block_bytes);
    }
    const bf16* runs[4];
    for (int64_t j = 0; j < subs; ++j) {
      const int64_t t = t0 + 16 * j;
      runs[j] = head_block(kc, table, t / bs, s.block_stride, head_off) + (t % bs) * 2;
    }
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      __m512 sc[4][4];
      switch (subs) {
        case 1: dot_heads<kDim, 1>(q, runs, bs, group, g0, sc); break;
        case 2: dot_heads<kDim, 2>(q, runs, bs, group, g0, sc); break;
        case 3: dot_heads<kDim, 3>(q, runs, bs, group, g0, sc); break;
        default: dot_heads<kDim, 4>(q, runs, bs, group, g0, sc); break;
      }
      for (int64_t g = g0; g < std::min<int64_t>(group, g0 + 4); ++g)
        for (int64_t j = 0; j < subs; ++j) {
          const int64_t left = n - 16 * j;
          _mm512_mask_storeu_ps(scores + g * len + t0 + 16 * j, lane_mask(left >= 16 ? 16 : static_cast<int>(left)),
                                _mm512_mul_ps(sc[g - g0][j], vscale));
        }
    }
  }
}

template <int kDim, typename O>
void pv_dot(const float* scores, const bf16* vc, const int32_t* table, int64_t len, const Shape& s, int64_t head_off,
            O* out) {
  constexpr int kMaxG = kDim == 64 ? 4 : 2;  // kMaxG * kDim / 16 accumulators + kDim / 16 values fit in 32 registers
  for (int64_t g0 = 0; g0 < s.group; g0 += kMaxG) {
    const float* p = scores + g0 * len;
    O* o = out + g0 * kDim;
    switch (std::min<int64_t>(kMaxG, s.group - g0)) {
      case 1: pv_slice<kDim, kDim, 1>(p, vc, table, len, s, head_off, 0, o); break;
      case 2: pv_slice<kDim, kDim, 2>(p, vc, table, len, s, head_off, 0, o); break;
      case 3: pv_slice<kDim, kDim, (kMaxG >= 3 ? 3 : 1)>(p, vc, table, len, s, head_off, 0, o); break;
      default: pv_slice<kDim, kDim, kMaxG>(p, vc, table, len, s, head_off, 0, o); break;
    }
  }
}

// One task (or piece) on the vdpbf16ps path: out its output rows, or with `part` its partial result.
template <int kDim>
void decode_task_dot(const bf16* q, const bf16* kc, const bf16* vc, const Window& w, const Shape& s, int64_t head_off,
                     bf16* out, float* part, Scratch& sc) {
  sc.scores.resize(s.group * w.len);
  float* scores = sc.scores.data();
  qk_dot<kDim>(q, kc, vc, w.table, w.len, s, head_off, scores);
  finish_scores(scores, s.group, w.len, w.masked, s.softcap);
  if (part) {
    exp_rows(scores, s.group, w.len, part, kDim);
    pv_dot<kDim>(scores, vc, w.table, w.len, s, head_off, part);
  } else {
    softmax_rows(scores, s.group, w.len);
    pv_dot<kDim>(scores, vc, w.table, w.len, s, head_off, out);
  }
}
#endif  // __AVX512BF16__

// ------------------------------------------------------------------ prompt tiles
// The rows of a prompt chunk share their request's table and attend to one more position each. Up to
// kTileVectors query vectors of such rows (rows x the group's heads) and one KV head make one task:
// its K/V blocks are read once for all of them (row by row, a 4k-token prompt at 32 KV heads read the
// whole 32 MiB of a layer's K/V again for every row, from DRAM: 1.9 s a layer at the SmolLM2-1.7B
// shape, 3.8x SDPA). Each row's positions past its own length, or before its own window's start, get -inf.
// - float32 / f16, and bf16 without AVX512-BF16: the vectors go through the FMA decode path as one group over
//   the last row's window (scores of the whole window, softmax, P.V), so a row gets exactly the numbers it gets
//   alone (the positions a row does not see add exact zeros);
// - bf16 on AVX512-BF16 (flash_tile_dot) and on AMX tiles at the "amx" level (flash_tile_amx): fused as flash
//   attention, chunk by chunk of positions with a running max and sum per vector, the weights rounded to bf16
//   for P.V as torch's flash attention rounds them (within two bf16 roundings of the rows). One layer, one
//   4,096-token prompt at the SmolLM2-1.7B shape, 2 threads of a Xeon with AMX (benchmarks/prompt_attention.py):
//   two-pass on vdpbf16ps 649 ms, fused 536, on AMX tiles 180 (torch's SDPA, AMX too: 166).

#ifdef __AVX512BF16__
// P.V of kR query vectors over `pairs` token pairs on vdpbf16ps: p (bf16 weight pairs, one 32-bit word a
// pair, row stride p_stride words), vp (each pair's kDim dims as kDim / 16 words of 16 (token, token + 1)
// dims); acc (kR x kDim float32) becomes acc * scale[r] + the products. Twice the work an FMA does per
// instruction.
template <int kDim, int kR>
inline void pv_pairs(const uint32_t* p, int64_t p_stride, const uint16_t* vp, int64_t pairs, const float* scale,
                     float* acc_io) {
  constexpr int kC = kDim / 16;
  __m512 acc[kR][kC];
  for (int r = 0; r < kR; ++r) {
    const __m512 a = _mm512_set1_ps(scale[r]);
    for (int c = 0; c < kC; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc_io + r * kDim + c * 16), a);
  }
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh w[kC];
    for (int c = 0; c < kC; ++c) w[c] = (__m512bh)_mm512_loadu_si512(vp + (j * kC + c) * 32);
    for (int r = 0; r < kR; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p[r * p_stride + j]));
      for (int c = 0; c < kC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pr, w[c]);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int c = 0; c < kC; ++c) _mm512_storeu_ps(acc_io + r * kDim + c * 16, acc[r][c]);
}

constexpr int64_t kFlashChunk = 64;  // positions per step of a fused tile: 32 vectors' scores (8 KiB) stay in L1

// Tokens [t, t + n) of a window's V (n <= kFlashChunk, t even) as pairs: word k of pair j's vector c holds dim
// 16c + k of tokens t + 2j and t + 2j + 1 (zero for a token past n), the layout vdpbf16ps multiplies; pairs past
// the last up to `pad_to` are zeros (an AMX tile reads 16 pairs).
template <int kDim>
inline void v_pairs(const bf16* vc, const int32_t* table, int64_t t, int64_t n, const Shape& s, int64_t head_off,
                    uint16_t* dst, int64_t pad_to) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                      36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  int64_t j = 0;
  for (; 2 * j < n; ++j) {
    const int64_t u = t + 2 * j;  // bs is even: u and u + 1 share a block
    const uint16_t* row = reinterpret_cast<const uint16_t*>(head_block(vc, table, u / s.bs, s.block_stride, head_off)) +
                          (u % s.bs) * kDim;
    for (int c2 = 0; c2 < kDim / 32; ++c2) {
      const __m512i a = _mm512_loadu_si512(row + c2 * 32);
      const __m512i b = 2 * j + 1 < n ? _mm512_loadu_si512(row + kDim + c2 * 32) : _mm512_setzero_si512();
      uint16_t* out = dst + (j * (kDim / 16) + 2 * c2) * 32;
      _mm512_storeu_si512(out, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(out + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
  if (j < pad_to) std::memset(dst + j * kDim * 2, 0, (pad_to - j) * kDim * 2 * sizeof(uint16_t));
}

// A fused tile's running state: n vectors (rows of `group` vectors each, n16 rounded up to 16) and their
// float32 outputs, each vector's running max m, sum l and this chunk's rescale alpha.
struct Flash {
  int64_t n, n16, group;
  float *S, *m, *l, *alpha, *O;
  uint16_t* P;  // this chunk's weights in bf16, n16 x kFlashChunk (rows past n stay zero)
};

inline Flash flash_begin(int64_t n, int64_t group, int64_t dim, Scratch& sc) {
  const int64_t n16 = (n + 15) / 16 * 16;
  sc.scores.resize(n16 * kFlashChunk);
  sc.acc.assign(n16 * dim, 0.f);
  sc.stats.assign(3 * n, 0.f);
  sc.p16.assign(n16 * kFlashChunk, 0);
  sc.pairs.resize(kFlashChunk * dim);
  Flash f{n,
          n16,
          group,
          sc.scores.data(),
          sc.stats.data(),
          sc.stats.data() + n,
          sc.stats.data() + 2 * n,
          sc.acc.data(),
          sc.p16.data()};
  std::fill(f.m, f.m + n, -std::numeric_limits<float>::infinity());
  return f;
}

// The chunk at t0 (c positions): the raw scores S (n x kFlashChunk q.k) scaled, capped, masked to each row's
// [begin, end) (bounds: 2 per row), then each vector's weights exp(score - running max) into P in bf16, its sum
// and max updated and alpha set to the factor its output must be rescaled by.
inline void flash_weights(Flash& f, const int64_t* bounds, int64_t t0, int64_t c, const Shape& s) {
  constexpr int64_t kC = kFlashChunk;
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < f.n; ++i) {
    float* si = f.S + i * kC;
    const int64_t r = i / f.group;
    const int64_t lo = std::clamp<int64_t>(bounds[2 * r] - t0, 0, c),
                  hi = std::clamp<int64_t>(bounds[2 * r + 1] - t0, 0, c);
    uint16_t* pi = f.P + i * kC;
    if (lo >= hi) {  // the row sees none of these positions: they add nothing
      f.alpha[i] = 1.f;
      std::memset(pi, 0, kC * sizeof(uint16_t));
      continue;
    }
    float mul = s.scale;    // scale > 0: the max of the raw scores is the max of the scaled ones
    if (s.softcap > 0.f) {  // Gemma 2: cap * tanh(scale * score / cap), then the weights of those
      for (int64_t t = lo; t < hi; ++t) si[t] = s.softcap * std::tanh(si[t] * s.scale / s.softcap);
      mul = 1.f;
    }
    if (lo > 0 || hi < kC) {
      std::fill(si, si + lo, kNone);
      std::fill(si + hi, si + kC, kNone);
    }
    __m512 mx = _mm512_loadu_ps(si);
    for (int64_t t = 16; t < kC; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(si + t));
    const float top = std::max(f.m[i], _mm512_reduce_max_ps(mx) * mul);  // finite: the row sees a position here
    f.alpha[i] = top == f.m[i] ? 1.f : std::exp(f.m[i] - top);           // 0 before the row's first position
    f.m[i] = top;
    // exp(mul * score - top) as 2^(log2e (mul * score - top)): one FMA in, the weights rounded to bf16 after (so
    // a coarser exp does: vexp2_neg_coarse); masked positions give 2^-inf = 0
    constexpr float kLog2e = 1.4426950408889634f;
    const __m512 vmul = _mm512_set1_ps(mul * kLog2e), vtop = _mm512_set1_ps(-top * kLog2e);
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < kC; t += 32) {
      const __m512 e0 = vexp2_neg_coarse(_mm512_fmadd_ps(_mm512_loadu_ps(si + t), vmul, vtop));
      const __m512 e1 = vexp2_neg_coarse(_mm512_fmadd_ps(_mm512_loadu_ps(si + t + 16), vmul, vtop));
      total = _mm512_add_ps(total, _mm512_add_ps(e0, e1));
      _mm512_storeu_si512(pi + t, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    f.l[i] = f.l[i] * f.alpha[i] + _mm512_reduce_add_ps(total);
  }
}

// Each vector's output O / l into ot (n x dim, bf16).
inline void flash_end(const Flash& f, int64_t dim, bf16* ot) {
  for (int64_t i = 0; i < f.n; ++i) {
    const __m512 inv = _mm512_set1_ps(1.f / f.l[i]);  // l >= 1: the max position adds exp(0)
    for (int64_t d = 0; d < dim; d += 16)
      vstore(ot + i * dim + d, _mm512_mul_ps(_mm512_loadu_ps(f.O + i * dim + d), inv));
  }
}

// The K and V blocks of the chunk after the one at t0.
inline void prefetch_next_chunk(const bf16* kc, const bf16* vc, const int32_t* table, int64_t t0, int64_t len,
                                const Shape& s, int64_t head_off) {
  for (int64_t b = (t0 + kFlashChunk) / s.bs; b * s.bs < std::min(len, t0 + 2 * kFlashChunk); ++b) {
    prefetch_bytes(head_block(kc, table, b, s.block_stride, head_off), s.bs * s.D * 2);
    prefetch_bytes(head_block(vc, table, b, s.block_stride, head_off), s.bs * s.D * 2);
  }
}

// A bf16 tile on vdpbf16ps, fused as flash attention: the window in chunks of kFlashChunk positions; each
// chunk's scores for the n vectors (qt, n x kDim) are computed, masked to each row's [begin, end) (bounds:
// 2 per row of `group` vectors), exponentiated against the vector's running max (its sum and output rescaled
// when the max rises), rounded to bf16 (as torch's flash attention does) and multiplied into float32
// outputs, so no score leaves L1 (two-pass, the 32 x 4k scores went to memory and back five times).
template <int kDim>
void flash_tile_dot(const bf16* qt, int64_t n, int64_t group, const int64_t* bounds, const bf16* kc, const bf16* vc,
                    const int32_t* table, int64_t len, const Shape& s, int64_t head_off, bf16* ot, Scratch& sc) {
  constexpr int64_t kC = kFlashChunk;
  constexpr int kR = kDim == 64 ? 6 : 3;  // kR x kDim / 16 sums + kDim / 16 values fit in 32 registers
  Flash f = flash_begin(n, group, kDim, sc);
  for (int64_t t0 = 0; t0 < len; t0 += kC) {
    const int64_t c = std::min(kC, len - t0);
    prefetch_next_chunk(kc, vc, table, t0, len, s, head_off);
    for (int64_t h0 = 0; h0 < c; h0 += 64) {  // 64 positions at a time: 4 runs of 16
      const int64_t subs = (std::min<int64_t>(64, c - h0) + 15) / 16;
      const bf16* runs[4];
      for (int64_t j = 0; j < subs; ++j) {
        const int64_t t = t0 + h0 + 16 * j;
        runs[j] = head_block(kc, table, t / s.bs, s.block_stride, head_off) + (t % s.bs) * 2;
      }
      for (int64_t g0 = 0; g0 < n; g0 += 4) {  // scores of 4 vectors x 64 positions at a time
        __m512 acc[4][4];
        switch (subs) {
          case 1: dot_heads<kDim, 1>(qt, runs, s.bs, n, g0, acc); break;
          case 2: dot_heads<kDim, 2>(qt, runs, s.bs, n, g0, acc); break;
          case 3: dot_heads<kDim, 3>(qt, runs, s.bs, n, g0, acc); break;
          default: dot_heads<kDim, 4>(qt, runs, s.bs, n, g0, acc); break;
        }
        for (int64_t i = g0; i < std::min(n, g0 + 4); ++i)
          for (int64_t j = 0; j < subs; ++j) _mm512_storeu_ps(f.S + i * kC + h0 + 16 * j, acc[i - g0][j]);
      }
    }
    flash_weights(f, bounds, t0, c, s);
    v_pairs<kDim>(vc, table, t0, c, s, head_off, sc.pairs.data(), 0);
    const uint32_t* p = reinterpret_cast<const uint32_t*>(f.P);
    const int64_t pairs = (c + 1) / 2;
    for (int64_t r0 = 0; r0 < n; r0 += kR) {
      const uint32_t* pr = p + r0 * kC / 2;
      float* o = f.O + r0 * kDim;
      const float* a = f.alpha + r0;
      switch (std::min<int64_t>(kR, n - r0)) {  // fewer than kR only for the tile's last vectors
        case 1: pv_pairs<kDim, 1>(pr, kC / 2, sc.pairs.data(), pairs, a, o); break;
        case 2: pv_pairs<kDim, 2>(pr, kC / 2, sc.pairs.data(), pairs, a, o); break;
        case 3: pv_pairs<kDim, 3>(pr, kC / 2, sc.pairs.data(), pairs, a, o); break;
        case 4: pv_pairs<kDim, (kR >= 4 ? 4 : 1)>(pr, kC / 2, sc.pairs.data(), pairs, a, o); break;
        case 5: pv_pairs<kDim, (kR >= 5 ? 5 : 1)>(pr, kC / 2, sc.pairs.data(), pairs, a, o); break;
        default: pv_pairs<kDim, (kR >= 6 ? 6 : 1)>(pr, kC / 2, sc.pairs.data(), pairs, a, o); break;
      }
    }
  }
  flash_end(f, kDim, ot);
}

#ifdef PL_AMX
// ------------------------------------------------------------------ AMX tiles (bf16, the "amx" level)
// The same fused tile with both products on AMX tiles, 16 vectors at a time. A block's K is stored as (dim
// pairs, tokens, 2): 16 tokens of 32 dims are one B tile read straight from the cache (row stride bs x 4
// bytes), q rows A tiles. The output of 16 vectors x 16 dims grows by one tile product per 32 positions (the
// bf16 weights A tiles, V pairs B tiles) and is added to the rescaled float32 outputs.

// S (16 x kFlashChunk) = 16 q rows (q16, kDim apart) . the chunk's `subs` runs of 16 K tokens. Tiles 0, 1: scores
// of two runs; 2-5: q by 32 dims; 6, 7: K.
template <int kDim>
__attribute__((target("amx-tile,amx-bf16"))) void amx_scores(const bf16* q16, const bf16* const* runs, int64_t subs,
                                                             int64_t bs, float* S) {
  constexpr int kQ = kDim / 32;
  constexpr int64_t qs = kDim * 2;  // bytes between q rows
  _tile_loadd(2, q16, qs);
  _tile_loadd(3, q16 + 32, qs);
  if constexpr (kQ > 2) {
    _tile_loadd(4, q16 + 64, qs);
    _tile_loadd(5, q16 + 96, qs);
  }
  const int64_t kstride = bs * 4, chunk = 16 * bs * 2;  // bytes between K pair rows; elements per 32 dims
  for (int64_t j = 0; j < subs; j += 2) {
    const bool two = j + 1 < subs;
    _tile_zero(0);
    _tile_zero(1);
#define PL_QK(c, qt)                                    \
  _tile_loadd(6, runs[j] + (c) * chunk, kstride);       \
  _tile_dpbf16ps(0, qt, 6);                             \
  if (two) {                                            \
    _tile_loadd(7, runs[j + 1] + (c) * chunk, kstride); \
    _tile_dpbf16ps(1, qt, 7);                           \
  }
    PL_QK(0, 2)
    PL_QK(1, 3)
    if constexpr (kQ > 2) {
      PL_QK(2, 4)
      PL_QK(3, 5)
    }
#undef PL_QK
    _tile_stored(0, S + j * 16, kFlashChunk * 4);
    if (two) _tile_stored(1, S + (j + 1) * 16, kFlashChunk * 4);
  }
}

// obuf (16 x kDim float32) = 16 vectors' weights (P16: kFlashChunk bf16 a row) . V pairs (vp: (pairs, kDim, 2))
// over pairs [0, pairs16), a multiple of 16. Tiles 0-3: 64 dims of output; 4: weights; 5: V pairs.
template <int kDim>
__attribute__((target("amx-tile,amx-bf16"))) void amx_output(const uint16_t* p16, const uint16_t* vp, int64_t pairs16,
                                                             float* obuf) {
  for (int64_t d0 = 0; d0 < kDim; d0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t jp = 0; jp < pairs16; jp += 16) {
      _tile_loadd(4, p16 + 2 * jp, kFlashChunk * 2);  // 16 vectors x 32 positions of weights
      const uint16_t* v = vp + (jp * kDim + d0) * 2;  // 16 pairs x 16 dims, rows kDim words apart
      _tile_loadd(5, v, kDim * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(5, v + 32, kDim * 4);
      _tile_dpbf16ps(1, 4, 5);
      _tile_loadd(5, v + 64, kDim * 4);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(5, v + 96, kDim * 4);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, obuf + d0, kDim * 4);
    _tile_stored(1, obuf + d0 + 16, kDim * 4);
    _tile_stored(2, obuf + d0 + 32, kDim * 4);
    _tile_stored(3, obuf + d0 + 48, kDim * 4);
  }
}

// A bf16 tile on AMX tiles: flash_tile_dot's steps with the products above. qt holds the n vectors and zero
// rows up to a multiple of 16.
template <int kDim>
void flash_tile_amx(const bf16* qt, int64_t n, int64_t group, const int64_t* bounds, const bf16* kc, const bf16* vc,
                    const int32_t* table, int64_t len, const Shape& s, int64_t head_off, bf16* ot, Scratch& sc) {
  constexpr int64_t kC = kFlashChunk;
  Flash f = flash_begin(n, group, kDim, sc);
  alignas(64) float obuf[16 * kDim];
  for (int64_t t0 = 0; t0 < len; t0 += kC) {
    const int64_t c = std::min(kC, len - t0), subs = (c + 15) / 16, pairs16 = ((c + 1) / 2 + 15) / 16 * 16;
    prefetch_next_chunk(kc, vc, table, t0, len, s, head_off);
    const bf16* runs[kC / 16];
    for (int64_t j = 0; j < subs; ++j) {
      const int64_t t = t0 + 16 * j;
      runs[j] = head_block(kc, table, t / s.bs, s.block_stride, head_off) + (t % s.bs) * 2;
    }
    for (int64_t r0 = 0; r0 < f.n16; r0 += 16) amx_scores<kDim>(qt + r0 * kDim, runs, subs, s.bs, f.S + r0 * kC);
    flash_weights(f, bounds, t0, c, s);
    v_pairs<kDim>(vc, table, t0, c, s, head_off, sc.pairs.data(), pairs16);
    for (int64_t r0 = 0; r0 < f.n16; r0 += 16) {
      amx_output<kDim>(f.P + r0 * kC, sc.pairs.data(), pairs16, obuf);
      for (int64_t i = r0; i < std::min(n, r0 + 16); ++i) {
        const __m512 a = _mm512_set1_ps(f.alpha[i]);
        float* o = f.O + i * kDim;
        for (int64_t d = 0; d < kDim; d += 16)
          _mm512_storeu_ps(o + d,
                           _mm512_fmadd_ps(_mm512_loadu_ps(o + d), a, _mm512_loadu_ps(obuf + (i - r0) * kDim + d)));
      }
    }
  }
  flash_end(f, kDim, ot);
}
#endif  // PL_AMX
#endif  // __AVX512BF16__

// One tile and KV head on a fast path: the rows' query vectors copied side by side and attended as one group
// over the last row's window, each row masked to its own positions (its length, its window's start): fused
// (flash_tile_dot) for bf16 at AVX512-BF16, else scored, softmaxed and multiplied into V in two passes; the
// outputs copied back.
template <int kDim, typename T>
void tile_task(const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* lens, const int32_t* starts,
               const Tile& tile, int64_t h, const Shape& s, T* out, Scratch& sc, int64_t cache_head) {
  const int64_t g = s.group, n = tile.rows * g, first = tile.row, last = tile.row + tile.rows - 1;
  const Window w0 = window_of(tables, lens, starts, first, s);  // the first row's start is the tile's earliest
  const int64_t skipped = lens[first] - w0.len, len = lens[last] - skipped, head_off = cache_head * s.bs * kDim;
  // the last row's table: every entry a row of the tile reads equals it (find_tiles), and it has them all
  const int32_t* table = tables + last * s.maxb + (w0.table - (tables + first * s.maxb));
  Shape st = s;
  st.group = n;
  const int64_t n16 = (n + 15) / 16 * 16;  // AMX tiles read q 16 rows at a time: zero rows after the last
  sc.tile.resize(((n16 + n) * kDim * sizeof(T) + sizeof(float) - 1) / sizeof(float));
  T* qt = reinterpret_cast<T*>(sc.tile.data());  // the query vectors, then the output rows: (rows, g, kDim) each
  T* ot = qt + n16 * kDim;
  for (int64_t r = 0; r < tile.rows; ++r)
    std::memcpy(qt + r * g * kDim, q + (first + r) * s.q_stride + h * g * kDim, g * kDim * sizeof(T));
  std::memset(static_cast<void*>(qt + n * kDim), 0, (n16 - n) * kDim * sizeof(T));
  sc.bounds.resize(2 * tile.rows);
  for (int64_t r = 0; r < tile.rows; ++r) {
    sc.bounds[2 * r] = starts == nullptr ? 0 : std::max<int64_t>(0, starts[first + r] - skipped);
    sc.bounds[2 * r + 1] = lens[first + r] - skipped;
  }
  bool fused = false;
#ifdef __AVX512BF16__
  if constexpr (std::is_same<T, bf16>::value) {
    fused = s.bs % 16 == 0;
#ifdef PL_AMX
    if (fused && s.amx) flash_tile_amx<kDim>(qt, n, g, sc.bounds.data(), kc, vc, table, len, s, head_off, ot, sc);
    else
#endif
        if (fused)
      flash_tile_dot<kDim>(qt, n, g, sc.bounds.data(), kc, vc, table, len, s, head_off, ot, sc);
  }
#endif
  if (!fused) {
    sc.scores.resize(n * len);
    float* scores = sc.scores.data();
    sc.qf.resize(n * kDim);
    for (int64_t i = 0; i < n * kDim; ++i) sc.qf[i] = to_f32(qt[i]);
    qk_fma<kDim, T>(sc.qf.data(), kc, vc, table, len, n, st, head_off, scores);
    finish_scores(scores, n, len, 0, s.softcap);
    constexpr float kNone = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t begin = sc.bounds[2 * (i / g)], end = sc.bounds[2 * (i / g) + 1];
      std::fill(scores + i * len, scores + i * len + begin, kNone);
      std::fill(scores + i * len + end, scores + (i + 1) * len, kNone);
    }
    softmax_rows(scores, n, len);
    constexpr int kW = kDim < kPassDims ? kDim : kPassDims;
    pv_heads<kDim, kW, std::max(1, kAccRegs / (kW / kLanes))>(scores, vc, table, len, st, head_off, ot);
  }
  for (int64_t r = 0; r < tile.rows; ++r)
    std::memcpy(out + ((first + r) * s.nh + h * g) * kDim, ot + r * g * kDim, g * kDim * sizeof(T));
}

// Every (tile, KV head) task (attention.h's run_tiles): a tile of one row on the row path, others in tiles.
template <typename T, typename RowTask>
void dispatch_tiles(const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* lens,
                    const int32_t* starts, const std::vector<Tile>& tiles, T* out, const Shape& s, int threads,
                    const RowTask& row_task) {
  run_tiles<Scratch>(tiles, lens, starts, s, threads, [&](const Tile& t, int64_t h, Scratch& sc) {
    if (t.rows == 1) row_task(t.row * s.nkv + h, sc);
    else if (s.D == 64) tile_task<64, T>(q, kc, vc, tables, lens, starts, t, h, s, out, sc, h);
    else tile_task<128, T>(q, kc, vc, tables, lens, starts, t, h, s, out, sc, h);
  });
}

template <typename T>
void dispatch(const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* lens, const int32_t* starts,
              T* out, int64_t rows, const Shape& s, int threads, int split) {
  const int64_t items = rows * s.nkv, D = s.D, bs = s.bs;
  const bool fast = (D == 64 || D == 128) && bs % kLanes == 0;  // runs of kLanes tokens never straddle a block
  // one task or piece: w its window, out its output rows or part its partial result
  auto attend = [&](int64_t task, const Window& w, float* part, Scratch& sc) {
    const int64_t seq = task / s.nkv, h = task % s.nkv, head_off = h * bs * D;
    const T* qrow = q + seq * s.q_stride + h * s.group * D;
    T* orow = out + (seq * s.nh + h * s.group) * D;
    if (!fast) return task_scalar<T>(qrow, kc, vc, w, head_off, s, orow, part, sc);
#ifdef __AVX512BF16__
    if constexpr (std::is_same<T, bf16>::value) {
      if (bs % 16 == 0) {
        if (D == 64) decode_task_dot<64>(qrow, kc, vc, w, s, head_off, orow, part, sc);
        else decode_task_dot<128>(qrow, kc, vc, w, s, head_off, orow, part, sc);
        return;
      }
    }
#endif
    if (D == 64) decode_task_fma<64, T>(qrow, kc, vc, w, s, head_off, orow, part, sc);
    else decode_task_fma<128, T>(qrow, kc, vc, w, s, head_off, orow, part, sc);
  };
  // the first K blocks of a task's window from `begin`: they load while the task before computes
  auto prefetch_start = [&](int64_t task, int64_t begin) {
    if (!fast) return;
    const Window w = window_of(tables, lens, starts, task / s.nkv, s);
    const int64_t head_off = (task % s.nkv) * bs * D;
    for (int64_t b = begin / bs; b < begin / bs + 2 && b * bs < w.len; ++b)
      prefetch_bytes(head_block(kc, w.table, b, s.block_stride, head_off), bs * D * sizeof(T));
  };
  if (fast && !(split & kNoTiles)) {
    const std::vector<Tile> tiles = find_tiles(
        tables, lens, starts, rows, s, std::max<int64_t>(1, (s.amx ? kAmxTileVectors : kTileVectors) / s.group));
    if (!tiles.empty()) {
      dispatch_tiles<T>(q, kc, vc, tables, lens, starts, tiles, out, s, threads, [&](int64_t task, Scratch& sc) {
        attend(task, window_of(tables, lens, starts, task / s.nkv, s), nullptr, sc);
      });
      return;
    }
  }
  const SplitPlan plan = plan_split(lens, starts, rows, s.nkv, bs, threads, split);
  if (plan.pieces.empty()) {
    parallel_by_length(lens, s.nkv, items, threads, [&](int64_t begin, int64_t end) {
      Scratch sc;
      for (int64_t task = begin; task < end; ++task) {
        if (task + 1 < end) prefetch_start(task + 1, 0);
        attend(task, window_of(tables, lens, starts, task / s.nkv, s), nullptr, sc);
      }
    });
    return;
  }
  std::vector<float> parts(plan.slots * partial_floats(s.group, D));
  run_split(
      plan,
      [&](int64_t begin, int64_t end) {
        Scratch sc;
        for (int64_t i = begin; i < end; ++i) {
          const Piece& p = plan.pieces[i];
          if (i + 1 < end) prefetch_start(plan.pieces[i + 1].task, plan.pieces[i + 1].begin);
          const Window w = piece_window(window_of(tables, lens, starts, p.task / s.nkv, s), p.begin, p.end, bs);
          attend(p.task, w, p.slot < 0 ? nullptr : parts.data() + p.slot * partial_floats(s.group, D), sc);
        }
      },
      [&](const Merge& m) {
        const int64_t seq = m.task / s.nkv, h = m.task % s.nkv;
        merge_partials<T>(parts.data() + m.first * partial_floats(s.group, D), m.count, s.group, D,
                          out + (seq * s.nh + h * s.group) * D);
      });
}

// pairs consecutive words of src to dst, dst + stride words, dst + 2 * stride words, ...
template <typename Word>
inline void scatter_pairs(const char* src, char* dst, int64_t pairs, int64_t stride) {
  Word* out = reinterpret_cast<Word*>(dst);
  for (int64_t p = 0; p < pairs; ++p) {
    Word w;
    std::memcpy(&w, src + p * sizeof(Word), sizeof(Word));  // the source row may be unaligned
    out[p * stride] = w;
  }
}
}  // namespace

template <typename T>
void pl::attend_prompt_tile(const T* q, const T* kc, const T* vc, const int32_t* table, const int32_t* lens,
                            const int32_t* starts, const Tile& tile, int64_t h, const Shape& s, T* out, Scratch& sc) {
  Shape one = s;
  one.maxb = 0;  // every row reads `table`
  one.block_stride = s.bs * s.D;
  if (s.D == 64) tile_task<64, T>(q, kc, vc, table, lens, starts, tile, h, one, out, sc, 0);
  else tile_task<128, T>(q, kc, vc, table, lens, starts, tile, h, one, out, sc, 0);
}
template void pl::attend_prompt_tile<float>(const float*, const float*, const float*, const int32_t*, const int32_t*,
                                            const int32_t*, const Tile&, int64_t, const Shape&, float*, Scratch&);
template void pl::attend_prompt_tile<bf16>(const bf16*, const bf16*, const bf16*, const int32_t*, const int32_t*,
                                           const int32_t*, const Tile&, int64_t, const Shape&, bf16*, Scratch&);
template void pl::attend_prompt_tile<f16>(const f16*, const f16*, const f16*, const int32_t*, const int32_t*,
                                          const int32_t*, const Tile&, int64_t, const Shape&, f16*, Scratch&);

// q (rows, nh, D), row stride q_stride, heads contiguous; key/value cache (blocks, nkv, bs, D), K
// pair-interleaved within each block; tables (rows, maxb) int32; lens (rows,) int32; out
// (rows, nh, D) contiguous. Every row attends to positions [starts[row], lens[row]) of its table
// (starts may be null: from 0; a sliding window otherwise); softcap > 0 caps the scores (Gemma 2).
// split: a pl::SplitMode (0 automatic, 1 never, 2 whenever a task is long enough).
PL_EXPORT int pl_paged_attention_window(const void* q, int64_t q_stride, const void* kc, const void* vc,
                                        const int32_t* tables, int64_t maxb, const int32_t* lens, const int32_t* starts,
                                        void* out, int64_t rows, int64_t nh, int64_t nkv, int64_t bs, int64_t D,
                                        float scale, float softcap, int dtype, int threads, int split) {
  if (nkv <= 0 || nh % nkv != 0) {
    pl::set_error("query heads (%lld) must be a multiple of KV heads (%lld)", static_cast<long long>(nh),
                  static_cast<long long>(nkv));
    return -1;
  }
  Shape s{nh, nkv, D, bs, maxb, q_stride, nh / nkv, nkv * bs * D, scale, softcap};
#ifdef PL_AMX
  s.amx = (split & kAmxTiles) && dtype == pl::kBF16 && pl::amx_permitted();
#endif
  return pl::with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    dispatch<T>(static_cast<const T*>(q), static_cast<const T*>(kc), static_cast<const T*>(vc), tables, lens, starts,
                static_cast<T*>(out), rows, s, threads, split);
    return 0;
  });
}

// Every row from position 0 (the decoder stack's entry point).
PL_EXPORT int pl_paged_attention(const void* q, int64_t q_stride, const void* kc, const void* vc, const int32_t* tables,
                                 int64_t maxb, const int32_t* lens, void* out, int64_t rows, int64_t nh, int64_t nkv,
                                 int64_t bs, int64_t D, float scale, int dtype, int threads) {
  return pl_paged_attention_window(q, q_stride, kc, vc, tables, maxb, lens, nullptr, out, rows, nh, nkv, bs, D, scale,
                                   0.f, dtype, threads, pl::kSplitAuto);
}

// How many pieces of split tasks a call with these rows would compute (0: no task is split), for
// the tests and benchmarks; the arguments as for pl_paged_attention_window (either cache type).
PL_EXPORT int64_t pl_attention_split_pieces(const int32_t* lens, const int32_t* starts, int64_t rows, int64_t nkv,
                                            int64_t bs, int threads, int split) {
  return pl::plan_split(lens, starts, rows, nkv, bs, threads, split).slots;
}

// How many tiles of more than one row paged attention would form for these rows (0: every row alone), for
// the tests and benchmarks; the arguments as for pl_paged_attention_window.
PL_EXPORT int64_t pl_attention_prompt_tiles(const int32_t* tables, int64_t maxb, const int32_t* lens,
                                            const int32_t* starts, int64_t rows, int64_t nh, int64_t nkv, int64_t bs) {
  if (nkv <= 0 || nh % nkv != 0) return 0;
  const Shape s{nh, nkv, 0, bs, maxb, 0, nh / nkv, 0, 1.f, 0.f};
  int64_t count = 0;
  for (const Tile& t : find_tiles(tables, lens, starts, rows, s, std::max<int64_t>(1, kTileVectors / s.group)))
    count += t.rows > 1;
  return count;
}

// Stores each new token's K and V (tokens, nkv, D; row strides ks / vs, head strides khs / vhs,
// in elements) in its cache slot: block slot / bs, offset slot % bs; K pair-interleaved. One copy
// per (token, head) instead of two advanced-indexing assignments per layer.
PL_EXPORT int pl_write_kv(const void* k, int64_t ks, int64_t khs, const void* v, int64_t vs, int64_t vhs, void* kc,
                          void* vc, const int64_t* slots, int64_t tokens, int64_t nkv, int64_t bs, int64_t D,
                          int64_t blocks, int64_t esize, int threads) {
  if (!pl::check_kv_write(slots, tokens, bs, D, blocks)) return -1;
  const char* kp = static_cast<const char*>(k);
  const char* vp = static_cast<const char*>(v);
  char* kcp = static_cast<char*>(kc);
  char* vcp = static_cast<char*>(vc);
  // a decode token's K lands in head_dim / 2 cache lines per head, each read from memory first: a step of 32
  // decodes is latency-bound, so 8 tokens already make a thread's share (1.7B shape, batch 32 decodes: 8.3-8.5 -> 5.2
  // ms a step)
  pl::parallel_for(tokens, threads, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = slots[t] / bs, o = slots[t] % bs;
      for (int64_t h = 0; h < nkv; ++h) {
        const int64_t head = (b * nkv + h) * bs * D * esize;  // this head's slots of block b
        const char* ksrc = kp + (t * ks + h * khs) * esize;
        // K: dims (2p, 2p+1) of slot o at ((p * bs) + o) * 2, a pair moved as one 4- or 8-byte word
        if (esize == 2) scatter_pairs<uint32_t>(ksrc, kcp + head + o * 4, D / 2, bs);
        else scatter_pairs<uint64_t>(ksrc, kcp + head + o * 8, D / 2, bs);
        std::memcpy(vcp + head + o * D * esize, vp + (t * vs + h * vhs) * esize, D * esize);
      }
    }
  });
  return 0;
}
