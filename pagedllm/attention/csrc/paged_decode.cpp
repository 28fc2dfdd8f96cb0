// Paged attention for rows of one query each, reading K/V in place from the block-structured
// cache: no gathered copy of the context, no padding to the longest sequence. A row is a decode
// token, or one token of a prompt chunk with the length of its causal prefix (the Python side
// gives every row its own block table and length).
//
// Work items are (row, KV head) pairs, spread over torch's intra-op threads with
// at::parallel_for (built with -fopenmp, the extension shares torch's libgomp.so.1 runtime).
// The query heads sharing a KV head are handled together so each K/V row is read once.
// Scores are float32: one pass over K, a softmax, one pass over V.
//
// Cache layout per block and KV head: V as (block_size, head_dim) rows; K pair-interleaved as
// (head_dim / 2, block_size, 2): dims (2p, 2p + 1) of every slot side by side (write_kv stores
// it so), which makes 16 tokens' q.k one vdpbf16ps chain with no horizontal sums (5-8% faster
// per layer than token rows reduced by transposes, measured at 256 x 210 and 64 x 600 tokens).
//
// bfloat16 with head_dim 64 or 128 and blocks of a multiple of 16 slots on AVX512-BF16 machines
// takes a hand-vectorised path (decode_task_avx512): q.k with vdpbf16ps on the stored bf16
// values, the K block two ahead and the V block of the same tokens prefetched while one is read,
// and P.V accumulated in float32 registers. Work is split between threads by total context
// length, not by row count, so a few long rows do not leave one thread idle.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PAGEDLLM_AVX512_BF16 1
#endif

namespace {
inline void load_row(const float* __restrict__ src, float* __restrict__ dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* __restrict__ bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* __restrict__ wide = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) wide[d] = static_cast<uint32_t>(bits[d]) << 16;
}
inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, at::BFloat16* dst, int64_t n) { for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<at::BFloat16>(src[d]); }

// Each of the ``rows`` runs of ``len`` scores becomes its softmax, in place.
inline void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* sg = scores + g * len;
    const float top = *std::max_element(sg, sg + len);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; ++t) {  // vectorised exp (libmvec) with -ffast-math
      sg[t] = std::exp(sg[t] - top);
      total += sg[t];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
  }
}

template <int kDim, typename T>
void decode_range(const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* lens, T* out,
                  int64_t begin, int64_t end, int64_t nh, int64_t nkv, int64_t bs, int64_t maxb, float scale,
                  int64_t head_dim, int64_t q_stride) {
  const int64_t D = kDim > 0 ? kDim : head_dim;  // compile-time head_dim for the common sizes: unrolled loops
  const int64_t group = nh / nkv, block_stride = nkv * bs * D;  // cache: (blocks, kv_heads, bs, D)
  std::vector<float> qf(group * D), acc(group * D), scores, kbuf(bs * D);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t seq = task / nkv, h = task % nkv, len = lens[seq];
    const int32_t* table = tables + seq * maxb;
    for (int64_t g = 0; g < group; ++g) {
      load_row(q + seq * q_stride + (h * group + g) * D, qf.data() + g * D, D);
      for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= scale;
    }
    scores.resize(group * len);
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
      const int64_t n = std::min<int64_t>(bs, len - t0);
      const T* base = kc + static_cast<int64_t>(table[t0 / bs]) * block_stride + h * bs * D;
      for (int64_t o = 0; o < n; ++o)  // K is stored pair-interleaved (see write_kv): gather token rows
        for (int64_t d = 0; d < D; ++d) kbuf[o * D + d] = static_cast<float>(base[((d >> 1) * bs + o) * 2 + (d & 1)]);
      for (int64_t g = 0; g < group; ++g) {
        const float* __restrict__ qg = qf.data() + g * D;
        for (int64_t o = 0; o < n; ++o) {
          const float* __restrict__ k = kbuf.data() + o * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
          scores[g * len + t0 + o] = s;
        }
      }
    }
    softmax_rows(scores.data(), group, len);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
      const int64_t n = std::min<int64_t>(bs, len - t0);
      const T* base = vc + static_cast<int64_t>(table[t0 / bs]) * block_stride + h * bs * D;
      load_row(base, kbuf.data(), n * D);
      for (int64_t g = 0; g < group; ++g) {
        float* __restrict__ ag = acc.data() + g * D;
        for (int64_t o = 0; o < n; ++o) {
          const float p = scores[g * len + t0 + o];
          const float* __restrict__ v = kbuf.data() + o * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) store_row(acc.data() + g * D, out + (seq * nh + h * group + g) * D, D);
  }
}

#ifdef PAGEDLLM_AVX512_BF16
inline void prefetch_block(const at::BFloat16* p, int64_t bytes) {
  // random block order defeats the hardware prefetcher at every block boundary; callers ask two
  // blocks ahead (measured at 256 x 330 tokens: 1.65 ms per layer against 1.98 one ahead, 4.1 before)
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// This KV head's slots of the i-th block of a row's table (one contiguous run of bs * kDim values).
inline const at::BFloat16* head_block(const at::BFloat16* cache, const int32_t* table, int64_t i, int64_t block_stride,
                                      int64_t head_off) {
  return cache + static_cast<int64_t>(table[i]) * block_stride + head_off;
}

// K blocks stored pair-interleaved per head: element (token t, dim d) at ((d / 2) * bs + t) * 2 + d % 2,
// so one 512-bit load holds dims (2p, 2p+1) of 16 tokens and vdpbf16ps against a broadcast q pair
// adds that pair's products to 16 tokens' scores at once: no horizontal sums. kSub runs of 16
// tokens share each broadcast (kG * kSub independent accumulators).
template <int kDim, int kG, int kSub>
inline void qk_pairs_tile(const at::BFloat16* q, const at::BFloat16* const* runs, int64_t bs, __m512 (*out)[4]) {
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
inline void qk_pairs_heads(const at::BFloat16* q, const at::BFloat16* const* runs, int64_t bs, int64_t group,
                           int64_t g0, __m512 (*out)[4]) {
  switch (std::min<int64_t>(4, group - g0)) {
    case 1: qk_pairs_tile<kDim, 1, kSub>(q + g0 * kDim, runs, bs, out); break;
    case 2: qk_pairs_tile<kDim, 2, kSub>(q + g0 * kDim, runs, bs, out); break;
    case 3: qk_pairs_tile<kDim, 3, kSub>(q + g0 * kDim, runs, bs, out); break;
    default: qk_pairs_tile<kDim, 4, kSub>(q + g0 * kDim, runs, bs, out); break;
  }
}

template <int kDim>
void qk_pairs_avx512(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc, const int32_t* table,
                     int64_t len, int64_t group, int64_t bs, int64_t block_stride, int64_t head_off, float scale,
                     float* scores) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const int64_t block_bytes = bs * kDim * 2;
  int64_t next_fetch = 0;  // first block not yet prefetched
  for (int64_t t0 = 0; t0 < len; t0 += 64) {
    const int64_t n = std::min<int64_t>(64, len - t0), subs = (n + 15) / 16;
    for (; next_fetch * bs < std::min(len, t0 + 64 + 2 * bs); ++next_fetch) {  // K two blocks ahead, V of these tokens
      prefetch_block(head_block(kc, table, next_fetch, block_stride, head_off), block_bytes);
      prefetch_block(head_block(vc, table, next_fetch, block_stride, head_off), block_bytes);
    }
    const at::BFloat16* runs[4];
    for (int64_t j = 0; j < subs; ++j) {
      const int64_t t = t0 + 16 * j;
      runs[j] = head_block(kc, table, t / bs, block_stride, head_off) + (t % bs) * 2;
    }
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      __m512 sc[4][4];
      switch (subs) {
        case 1: qk_pairs_heads<kDim, 1>(q, runs, bs, group, g0, sc); break;
        case 2: qk_pairs_heads<kDim, 2>(q, runs, bs, group, g0, sc); break;
        case 3: qk_pairs_heads<kDim, 3>(q, runs, bs, group, g0, sc); break;
        default: qk_pairs_heads<kDim, 4>(q, runs, bs, group, g0, sc); break;
      }
      for (int64_t g = g0; g < std::min<int64_t>(group, g0 + 4); ++g)
        for (int64_t j = 0; j < subs; ++j) {
          const int64_t left = n - 16 * j;
          const __mmask16 m = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
          _mm512_mask_storeu_ps(scores + g * len + t0 + 16 * j, m, _mm512_mul_ps(sc[g - g0][j], vscale));
        }
    }
  }
}

// out_g = sum_t p[g * len + t] * v_t for kG query heads (float32 accumulators in registers).
template <int kDim, int kG>
void pv_avx512(const float* p, const at::BFloat16* vc, const int32_t* table, int64_t len, int64_t bs,
               int64_t block_stride, int64_t head_off, at::BFloat16* out, int64_t out_stride) {
  constexpr int kVec = kDim / 16;
  __m512 acc[kG][kVec];
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kVec; ++c) acc[g][c] = _mm512_setzero_ps();
  const int64_t block_bytes = bs * kDim * 2;
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int64_t n = std::min<int64_t>(bs, len - t0);
    const at::BFloat16* base = head_block(vc, table, t0 / bs, block_stride, head_off);
    // again, though the K pass asked for these blocks: long contexts outgrow L1 (measured: dropping it is slower)
    if (t0 + 2 * bs < len) prefetch_block(head_block(vc, table, t0 / bs + 2, block_stride, head_off), block_bytes);
    for (int64_t o = 0; o < n; ++o) {
      // 32 bf16 per load; as float32, the even dims are the words shifted up and the odd dims the
      // words masked (2 ops per 32 values instead of 4): acc[g][2c] holds even dims, [2c+1] odd
      __m512 v[kVec];
      for (int c = 0; c < kVec / 2; ++c) {
        const __m512i w = _mm512_loadu_si512(base + o * kDim + c * 32);
        v[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        v[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      }
      for (int g = 0; g < kG; ++g) {
        const __m512 w = _mm512_set1_ps(p[g * len + t0 + o]);
        for (int c = 0; c < kVec; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
      }
    }
  }
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);  // even/odd -> dims 0-15
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));                                 // -> dims 16-31
  for (int g = 0; g < kG; ++g)
    for (int c = 0; c < kVec / 2; ++c) {  // round to nearest even, as static_cast<at::BFloat16> does
      at::BFloat16* dst = out + g * out_stride + c * 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(
                              _mm512_permutex2var_ps(acc[g][2 * c], lo, acc[g][2 * c + 1])));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), (__m256i)_mm512_cvtneps_pbh(
                              _mm512_permutex2var_ps(acc[g][2 * c], hi, acc[g][2 * c + 1])));
    }
}

template <int kDim>
void decode_task_avx512(const at::BFloat16* q, const at::BFloat16* kc, const at::BFloat16* vc, const int32_t* table,
                        int64_t len, int64_t group, int64_t bs, int64_t block_stride, int64_t head_off, float scale,
                        at::BFloat16* out, std::vector<float>& scores) {
  scores.resize(group * len);
  qk_pairs_avx512<kDim>(q, kc, vc, table, len, group, bs, block_stride, head_off, scale, scores.data());
  softmax_rows(scores.data(), group, len);
  constexpr int kMaxG = kDim == 64 ? 4 : 2;  // kMaxG * kDim / 16 accumulators + kDim / 16 values fit in 32 registers
  for (int64_t g0 = 0; g0 < group; g0 += kMaxG) {
    const float* p = scores.data() + g0 * len;
    at::BFloat16* o = out + g0 * kDim;
    switch (std::min<int64_t>(kMaxG, group - g0)) {  // case 3 is reached only when kMaxG is 4
      case 1: pv_avx512<kDim, 1>(p, vc, table, len, bs, block_stride, head_off, o, kDim); break;
      case 2: pv_avx512<kDim, 2>(p, vc, table, len, bs, block_stride, head_off, o, kDim); break;
      case 3: pv_avx512<kDim, (kMaxG >= 3 ? 3 : 1)>(p, vc, table, len, bs, block_stride, head_off, o, kDim); break;
      default: pv_avx512<kDim, kMaxG>(p, vc, table, len, bs, block_stride, head_off, o, kDim); break;
    }
  }
}
#endif  // PAGEDLLM_AVX512_BF16

// Splits the (row, KV head) tasks into one contiguous range per thread with about equal
// total context length, and runs fn(begin, end) on each.
template <typename Fn>
void parallel_by_length(const int32_t* lens, int64_t nkv, int64_t items, const Fn& fn) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::vector<int64_t> cum(items + 1, 0);  // cost of a task: its context length + a fixed overhead
  for (int64_t i = 0; i < items; ++i) cum[i + 1] = cum[i] + lens[i / nkv] + 16;
  at::parallel_for(0, threads, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) {
      const int64_t begin = std::lower_bound(cum.begin(), cum.end(), cum[items] * t / threads) - cum.begin();
      const int64_t end = std::lower_bound(cum.begin(), cum.end(), cum[items] * (t + 1) / threads) - cum.begin();
      if (begin < end) fn(std::min(begin, items), std::min(end, items));
    }
  });
}

template <typename T>
void dispatch(torch::Tensor& q, torch::Tensor& kc, torch::Tensor& vc, torch::Tensor& tables, torch::Tensor& lens,
              torch::Tensor& out, float scale) {
  const int64_t nh = q.size(1), D = q.size(2), nkv = kc.size(1), bs = kc.size(2), maxb = tables.size(1);
  const int64_t items = q.size(0) * nkv, q_stride = q.stride(0);
  const int32_t* lens_p = lens.data_ptr<int32_t>();
#ifdef PAGEDLLM_AVX512_BF16
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if ((D == 64 || D == 128) && bs % 16 == 0) {  // runs of 16 tokens never straddle a block
      const at::BFloat16* qp = q.data_ptr<T>();
      const at::BFloat16* kp = kc.data_ptr<T>();
      const at::BFloat16* vp = vc.data_ptr<T>();
      const int32_t* tp = tables.data_ptr<int32_t>();
      at::BFloat16* op = out.data_ptr<T>();
      const int64_t group = nh / nkv, block_stride = nkv * bs * D;
      auto* task_fn = D == 64 ? decode_task_avx512<64> : decode_task_avx512<128>;
      parallel_by_length(lens_p, nkv, items, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        for (int64_t task = begin; task < end; ++task) {
          if (task + 1 < end) {  // the next task's first K blocks load while this one computes
            const int64_t nseq = (task + 1) / nkv, nhead = (task + 1) % nkv;
            for (int64_t b = 0; b < 2 && b * bs < lens_p[nseq]; ++b)
              prefetch_block(head_block(kp, tp + nseq * maxb, b, block_stride, nhead * bs * D), bs * D * 2);
          }
          const int64_t seq = task / nkv, h = task % nkv, off = (seq * nh + h * group) * D;
          task_fn(qp + seq * q_stride + h * group * D, kp, vp, tp + seq * maxb, lens_p[seq], group, bs, block_stride,
                  h * bs * D, scale, op + off, scores);
        }
      });
      return;
    }
  }
#endif
  auto run = [&](auto dim) {
    parallel_by_length(lens_p, nkv, items, [&](int64_t begin, int64_t end) {
      decode_range<decltype(dim)::value>(q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(),
                                         tables.data_ptr<int32_t>(), lens_p, out.data_ptr<T>(),
                                         begin, end, nh, nkv, bs, maxb, scale, D, q_stride);
    });
  };
  switch (D) {
    case 64: run(std::integral_constant<int, 64>{}); break;
    case 128: run(std::integral_constant<int, 128>{}); break;
    default: run(std::integral_constant<int, 0>{});
  }
}

}  // namespace

// q: (num_seqs, num_heads, head_dim), rows may be strided (a view of the packed qkv); key/value
// cache: (num_blocks, kv_heads, block_size, head_dim); tables: (num_seqs, max_blocks) int32;
// lens: (num_seqs,) int32; out: contiguous, shaped like q (filled).
void paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables, torch::Tensor lens,
                  torch::Tensor out, double scale) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q rows must hold their heads contiguously");
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && out.is_contiguous() && out.sizes() == q.sizes());
  TORCH_CHECK(tables.scalar_type() == torch::kInt32 && lens.scalar_type() == torch::kInt32);
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous() && q.size(1) % kc.size(1) == 0);
  TORCH_CHECK(q.scalar_type() == kc.scalar_type() && q.scalar_type() == vc.scalar_type());
  pybind11::gil_scoped_release nogil;
  if (q.scalar_type() == torch::kBFloat16) {
    dispatch<at::BFloat16>(q, kc, vc, tables, lens, out, static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32, "paged_decode supports float32 and bfloat16");
    dispatch<float>(q, kc, vc, tables, lens, out, static_cast<float>(scale));
  }
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

// Stores each new token's K and V (tokens, kv_heads, head_dim; rows may be strided views of the
// packed qkv) in its cache slot: block slot / block_size, offset slot % block_size. One copy per
// (token, head) instead of two advanced-indexing assignments per layer.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots) {
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes() && kc.dim() == 4);
  TORCH_CHECK(k.scalar_type() == kc.scalar_type() && v.scalar_type() == kc.scalar_type());
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == k.size(0));
  const int64_t nkv = kc.size(1), bs = kc.size(2), D = kc.size(3), blocks = kc.size(0);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(1) == nkv && k.size(2) == D && k.stride(2) == 1 && v.stride(2) == 1);
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  const int64_t esize = kc.element_size(), tokens = k.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kcp = static_cast<char*>(kc.data_ptr());
  char* vcp = static_cast<char*>(vc.data_ptr());
  for (int64_t t = 0; t < tokens; ++t)  // checked up front: no exception inside the parallel region
    TORCH_CHECK(sp[t] >= 0 && sp[t] / bs < blocks, "slot ", sp[t], " is outside the KV cache");
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {  // prompt chunks: thousands of rows
  for (int64_t t = begin; t < end; ++t) {
    const int64_t slot = sp[t], b = slot / bs, o = slot % bs;
    for (int64_t h = 0; h < nkv; ++h) {
      const int64_t head = (b * nkv + h) * bs * D * esize;  // this head's slots of block b
      const char* ksrc = kp + (t * k.stride(0) + h * k.stride(1)) * esize;
      // K: dims (2p, 2p+1) of slot o at ((p * bs) + o) * 2, a pair moved as one 4- or 8-byte word
      if (esize == 2) scatter_pairs<uint32_t>(ksrc, kcp + head + o * 4, D / 2, bs);
      else if (esize == 4) scatter_pairs<uint64_t>(ksrc, kcp + head + o * 8, D / 2, bs);
      else
        for (int64_t p = 0; p < D / 2; ++p)
          std::memcpy(kcp + head + (p * bs + o) * 2 * esize, ksrc + 2 * p * esize, 2 * esize);
      std::memcpy(vcp + head + o * D * esize, vp + (t * v.stride(0) + h * v.stride(1)) * esize, D * esize);
    }
  }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", &write_kv, "store new K/V rows in their cache slots");
  m.def("paged_decode", &paged_decode, "Paged attention for rows of one query each (decode tokens or causal prompt rows)");
}
