// y = x W^T (+ b) with W packed once after loading (layers/prepack.py), optionally with
// silu(gate) * up fused into the epilogue. Two kernels:
//
// FMA (every level; float, bf16 and f16 storage, float32 sums). Output features in blocks of
// kNB = 4 vectors (32 on AVX2, 64 on AVX-512; the last block may be narrower); a block of width w
// is (K, w): for each input feature, the w weights side by side. bf16 weights are stored so that
// one load of 2 vectors' worth splits into two float32 vectors with a shift and a mask (outputs
// i and L + i share a 32-bit word), f16 ones are widened by F16C. bf16 / f16 activations are
// widened to a float32 copy of the row chunk once per thread, then every k broadcasts one value
// against the block's weights. Register tiles: 6 rows x 4 vectors on AVX-512 (24 accumulators),
// 6 rows x 2 vectors on AVX2 (12 of its 16 registers), and 1-2 row remainders 4 vectors wide
// (enough independent sums to hide the FMA latency in a one-row decode). Each output is one
// float32 sum in k order whatever the tile, so a row's result does not depend on the batch.
//
// vdpbf16ps (avx512_bf16 level, bf16): blocks of 64 outputs as (K/2, w, 2), the two weights of
// an input pair side by side, so one vdpbf16ps adds a pair's products to 16 sums. On 2 cores,
// SmolLM2-135M's 30 layers with weights streamed from memory: 1 row 6.2 -> 4.2 ms, 256 rows
// 56.3 -> 53.6, 2048 rows 427 -> 418 against oneDNN's prepacked matmul.
#include <algorithm>
#include <vector>
#include "common.h"

namespace {
using namespace pl;

constexpr int64_t kNB = 4 * kLanes;
constexpr int kMR = 6;
#ifdef PL_AVX512
constexpr int kBigNV = 4;  // 6 x 4 accumulators + 4 weights + 1 broadcast of 32 registers
#else
constexpr int kBigNV = 2;  // 6 x 2 accumulators + 2 weights + 1 broadcast of 16 registers
#endif

// Where column `col` of a block of `width` outputs sits in each packed k row.
template <typename T>
inline int64_t packed_pos(int64_t col, int64_t width) {
  if (!std::is_same<T, bf16>::value) return col;
  const int64_t pair = col / (2 * kLanes), local = col % (2 * kLanes);
  if ((pair + 1) * 2 * kLanes > width) return col;  // a lone last vector: plain order
  return pair * 2 * kLanes + (local < kLanes ? 2 * local : 2 * (local - kLanes) + 1);
}

template <typename T, int NV>
inline void load_w(const T* p, V (&w)[NV]) {
  if constexpr (std::is_same<T, bf16>::value) {
    for (int v = 0; v + 1 < NV; v += 2) vload_split(p + v * kLanes, w[v], w[v + 1]);
    if (NV % 2) w[NV - 1] = vload(p + (NV - 1) * kLanes);
  } else {
    for (int v = 0; v < NV; ++v) w[v] = vload(p + v * kLanes);
  }
}

// MR rows x NV vectors of outputs: c = a b (+ bias), or with `silu` the vector pairs (gate, up)
// become silu(gate) * up, each product rounded to T where torch's unfused ops round it.
template <int MR, int NV, typename T>
void fma_tile(const float* a, int64_t lda, const T* b, int64_t bw, int64_t K, T* c, int64_t ldc, const float* bias,
              bool silu) {
  V acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    V w[NV];
    load_w<T, NV>(b + k * bw, w);
    for (int r = 0; r < MR; ++r) {
      const V x = vset1(a[r * lda + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = vfma(x, w[v], acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (bias)
      for (int v = 0; v < NV; ++v) acc[r][v] = vadd(acc[r][v], vload(bias + v * kLanes));
    if (silu) {
      for (int v = 0; v + 1 < NV; v += 2) {
        const V y = vmul(vround_as<T>(vsilu(vround_as<T>(acc[r][v]))), vround_as<T>(acc[r][v + 1]));
        vstore(c + r * ldc + (v / 2) * kLanes, y);
      }
    } else {
      for (int v = 0; v < NV; ++v) vstore(c + r * ldc + v * kLanes, acc[r][v]);
    }
  }
}

template <int MR, typename T>
void fma_tile_nv(int nv, const float* a, int64_t lda, const T* b, int64_t bw, int64_t K, T* c, int64_t ldc,
                 const float* bias, bool silu) {
  switch (nv) {
    case 1: fma_tile<MR, 1, T>(a, lda, b, bw, K, c, ldc, bias, silu); break;
    case 2: fma_tile<MR, 2, T>(a, lda, b, bw, K, c, ldc, bias, silu); break;
    case 3: fma_tile<MR, 3, T>(a, lda, b, bw, K, c, ldc, bias, silu); break;
    default: fma_tile<MR, 4, T>(a, lda, b, bw, K, c, ldc, bias, silu); break;
  }
}

template <typename T>
void fma_tile_rows(int mr, int nv, const float* a, int64_t lda, const T* b, int64_t bw, int64_t K, T* c, int64_t ldc,
                   const float* bias, bool silu) {
  switch (mr) {
    case 1: fma_tile_nv<1, T>(nv, a, lda, b, bw, K, c, ldc, bias, silu); break;
    case 2: fma_tile_nv<2, T>(nv, a, lda, b, bw, K, c, ldc, bias, silu); break;
    case 3: fma_tile_nv<3, T>(nv, a, lda, b, bw, K, c, ldc, bias, silu); break;
    case 4: fma_tile_nv<4, T>(nv, a, lda, b, bw, K, c, ldc, bias, silu); break;
    case 5: fma_tile_nv<5, T>(nv, a, lda, b, bw, K, c, ldc, bias, silu); break;
    default: fma_tile_nv<6, T>(nv, a, lda, b, bw, K, c, ldc, bias, silu); break;
  }
}

// All rows of one packed block (width bw at output n0 of the layer's outputs).
template <typename T>
void fma_block(const float* a, int64_t lda, const T* b, int64_t bw, int64_t K, T* c, int64_t ldc, const float* bias,
               int64_t rows, bool silu) {
  const int nv = static_cast<int>(bw / kLanes);
  int64_t r = 0;
  for (; r + kMR <= rows; r += kMR)
    for (int v0 = 0; v0 < nv; v0 += kBigNV)
      fma_tile_rows<T>(kMR, std::min(kBigNV, nv - v0), a + r * lda, lda, b + v0 * kLanes, bw, K,
                       c + r * ldc + (silu ? v0 / 2 : v0) * kLanes, ldc, bias ? bias + v0 * kLanes : nullptr, silu);
  const int left = static_cast<int>(rows - r);
  if (!left) return;
  const int step = left <= 2 ? 4 : kBigNV;  // one or two rows: 4 vectors of independent sums
  for (int v0 = 0; v0 < nv; v0 += step)
    fma_tile_rows<T>(left, std::min(step, nv - v0), a + r * lda, lda, b + v0 * kLanes, bw, K,
                     c + r * ldc + (silu ? v0 / 2 : v0) * kLanes, ldc, bias ? bias + v0 * kLanes : nullptr, silu);
}

template <typename T>
void fma_pack(const T* w, T* out, int64_t N, int64_t K, int threads) {
  parallel_for((N + kNB - 1) / kNB, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kNB, width = std::min(kNB, N - n0);
      T* d = out + n0 * K;  // every earlier block is full: block blk starts at n0 * K
      for (int64_t col = 0; col < width; ++col) {
        const int64_t pos = packed_pos<T>(col, width);
        for (int64_t k = 0; k < K; ++k) d[k * width + pos] = w[(n0 + col) * K + k];
      }
    }
  });
}

// Row chunks and the units of work: (chunk, block) pairs in chunk-major order, so a thread's
// consecutive units share its chunk of x (widened once, kept in cache while blocks stream past).
struct Units {
  int64_t blocks, chunk, chunks;
  Units(int64_t M, int64_t N, int64_t nb, int64_t max_chunk, int threads) {
    blocks = (N + nb - 1) / nb;
    chunks = (M + max_chunk - 1) / max_chunk;
    while (blocks * chunks < 8 * threads && (M + chunks) / (chunks + 1) >= kMR) ++chunks;  // work for every thread
    chunk = ((M + chunks - 1) / chunks + kMR - 1) / kMR * kMR;  // equal chunks of whole tiles
    chunks = (M + chunk - 1) / chunk;
  }
  int64_t count() const { return blocks * chunks; }
};

template <typename T>
void fma_gemm(const T* x, int64_t lda, const T* packed, const float* bias, T* out, int64_t ldc, int64_t M, int64_t N,
              int64_t K, bool silu, int threads) {
  const Units units(M, N, kNB, 96, threads);
  parallel_for(units.count(), threads, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> wide;  // this thread's chunk of x in float32 (bf16 / f16 storage)
    int64_t widened = -1;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t ci = u / units.blocks, m0 = ci * units.chunk, n0 = (u % units.blocks) * kNB;
      const int64_t rows = std::min(units.chunk, M - m0), width = std::min(kNB, N - n0);
      const float* a;
      int64_t a_ld;
      if constexpr (std::is_same<T, float>::value) {
        a = x + m0 * lda;
        a_ld = lda;
      } else {
        if (widened != ci) {
          wide.resize(rows * K);
          for (int64_t r = 0; r < rows; ++r) {
            const T* src = x + (m0 + r) * lda;
            int64_t k = 0;
            for (; k + kLanes <= K; k += kLanes) vstore(wide.data() + r * K + k, vload(src + k));
            for (; k < K; ++k) wide[r * K + k] = to_f32(src[k]);
          }
          widened = ci;
        }
        a = wide.data();
        a_ld = K;
      }
      fma_block<T>(a, a_ld, packed + n0 * K, width, K, out + m0 * ldc + (silu ? n0 / 2 : n0), ldc,
                   bias ? bias + n0 : nullptr, rows, silu);
    }
  });
}

#ifdef __AVX512BF16__
// ------------------------------------------------------------------ vdpbf16ps (bf16 x bf16)
constexpr int64_t kDotNB = 64;

template <int MR, int NV, bool kSilu>
inline void dot_tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t pairs, uint16_t* c, int64_t ldc,
                     const float* bias) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(b + (p * NV + v) * 32);
    for (int r = 0; r < MR; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + r * lda + 2 * p));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, w[v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      if (bias) acc[r][v] = _mm512_add_ps(acc[r][v], _mm512_loadu_ps(bias + v * 16));
  bf16* out = reinterpret_cast<bf16*>(c);
  if constexpr (kSilu) {  // the block's first 32 outputs are gate features, the last 32 the matching up ones
    static_assert(NV == 4, "a SiLU block is 32 gate + 32 up features");
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 2; ++v) {  // the GEMM output rounded to bf16 first, as torch stores it
        const V y = vmul(vround_as<bf16>(vsilu(vround_as<bf16>(acc[r][v]))), vround_as<bf16>(acc[r][v + 2]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldc + v * 16), (__m256i)_mm512_cvtneps_pbh(y));
      }
  } else {
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldc + v * 16), (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
  }
}

template <int NV, bool kSilu = false>
void dot_rows(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t pairs, uint16_t* c, int64_t ldc,
              const float* bias, int64_t rows) {
  int64_t r = 0;
  for (; r + kMR <= rows; r += kMR) dot_tile<kMR, NV, kSilu>(a + r * lda, lda, b, pairs, c + r * ldc, ldc, bias);
  a += r * lda;
  c += r * ldc;
  switch (rows - r) {
    case 1: dot_tile<1, NV, kSilu>(a, lda, b, pairs, c, ldc, bias); break;
    case 2: dot_tile<2, NV, kSilu>(a, lda, b, pairs, c, ldc, bias); break;
    case 3: dot_tile<3, NV, kSilu>(a, lda, b, pairs, c, ldc, bias); break;
    case 4: dot_tile<4, NV, kSilu>(a, lda, b, pairs, c, ldc, bias); break;
    case 5: dot_tile<5, NV, kSilu>(a, lda, b, pairs, c, ldc, bias); break;
    default: break;
  }
}

void dot_pack(const uint16_t* src, uint16_t* dst, int64_t N, int64_t K, int threads) {
  parallel_for((N + kDotNB - 1) / kDotNB, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kDotNB, width = std::min(kDotNB, N - n0);
      uint16_t* d = dst + n0 * K;
      for (int64_t p = 0; p < K / 2; ++p)
        for (int64_t col = 0; col < width; ++col) {
          d[(p * width + col) * 2] = src[(n0 + col) * K + 2 * p];
          d[(p * width + col) * 2 + 1] = src[(n0 + col) * K + 2 * p + 1];
        }
    }
  });
}

void dot_gemm(const uint16_t* a, int64_t lda, const uint16_t* b, const float* bias, uint16_t* c, int64_t ldc, int64_t M,
              int64_t N, int64_t K, bool silu, int threads) {
  const Units units(M, N, kDotNB, 256, threads);  // a chunk of x stays in L2 while weight blocks stream past
  parallel_for(units.count(), threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t m0 = (u / units.blocks) * units.chunk, n0 = (u % units.blocks) * kDotNB;
      const int64_t rows = std::min(units.chunk, M - m0), width = std::min(kDotNB, N - n0);
      const uint16_t* ab = a + m0 * lda;
      const uint16_t* bb = b + n0 * K;
      uint16_t* cb = c + m0 * ldc + (silu ? n0 / 2 : n0);
      const float* bias_b = bias ? bias + n0 : nullptr;
      if (silu) {
        dot_rows<4, true>(ab, lda, bb, K / 2, cb, ldc, bias_b, rows);
        continue;
      }
      switch (width / 16) {
        case 4: dot_rows<4>(ab, lda, bb, K / 2, cb, ldc, bias_b, rows); break;
        case 3: dot_rows<3>(ab, lda, bb, K / 2, cb, ldc, bias_b, rows); break;
        case 2: dot_rows<2>(ab, lda, bb, K / 2, cb, ldc, bias_b, rows); break;
        default: dot_rows<1>(ab, lda, bb, K / 2, cb, ldc, bias_b, rows); break;
      }
    }
  });
}
constexpr bool kHasDot = true;
#else
constexpr bool kHasDot = false;
#endif

bool use_dot(int dtype) { return kHasDot && dtype == kBF16; }
}  // namespace

// The packed layout for `dtype`: outputs per block, how many gate (then up) features alternate
// in a weight packed for the fused SiLU, and whether in_features must be even (1) or any (0).
// Output features must be a multiple of `lanes`.
PL_EXPORT int pl_gemm_layout(int dtype, int64_t* block, int64_t* lanes, int64_t* silu_group, int* even_k) {
  if (dtype < kF32 || dtype > kF16) {
    set_error("unknown dtype code %d", dtype);
    return -1;
  }
#ifdef __AVX512BF16__
  if (use_dot(dtype)) {
    *block = kDotNB, *lanes = 16, *silu_group = 32, *even_k = 1;
    return 0;
  }
#endif
  *block = kNB, *lanes = kLanes, *silu_group = kLanes, *even_k = 0;
  return 0;
}

// (N, K) weight -> the packed copy (N * K elements) read by pl_gemm.
PL_EXPORT int pl_gemm_pack(const void* w, void* out, int64_t N, int64_t K, int dtype, int threads) {
  if (N % kLanes != 0 && !(use_dot(dtype) && N % 16 == 0)) {
    set_error("packing needs out_features to be a multiple of %d, got %lld", kLanes, static_cast<long long>(N));
    return -1;
  }
#ifdef __AVX512BF16__
  if (use_dot(dtype)) {
    if (K % 2) {
      set_error("packing for vdpbf16ps needs an even in_features, got %lld", static_cast<long long>(K));
      return -1;
    }
    dot_pack(static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), N, K, threads);
    return 0;
  }
#endif
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    fma_pack<T>(static_cast<const T*>(w), static_cast<T*>(out), N, K, threads);
    return 0;
  });
}

// out (M, ldc) = x (M, K; row stride lda) W^T + bias, W packed by pl_gemm_pack; bias float32 or
// null. With silu the weight's rows were packed gate/up alternating (pl_gemm_layout's silu_group)
// and out is (M, N / 2) silu(gate) * up.
PL_EXPORT int pl_gemm(const void* x, int64_t lda, const void* packed, const float* bias, void* out, int64_t ldc,
                      int64_t M, int64_t N, int64_t K, int dtype, int silu, int threads) {
  if (M == 0) return 0;
#ifdef __AVX512BF16__
  if (use_dot(dtype)) {
    if (silu && N % kDotNB) {
      set_error("the fused SiLU needs whole blocks of %lld features", static_cast<long long>(kDotNB));
      return -1;
    }
    dot_gemm(static_cast<const uint16_t*>(x), lda, static_cast<const uint16_t*>(packed), bias,
             static_cast<uint16_t*>(out), ldc, M, N, K, silu != 0, threads);
    return 0;
  }
#endif
  if (silu && N % (2 * kLanes)) {
    set_error("the fused SiLU needs gate/up groups of %d features", kLanes);
    return -1;
  }
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    fma_gemm<T>(static_cast<const T*>(x), lda, static_cast<const T*>(packed), bias, static_cast<T*>(out), ldc, M, N, K,
                silu != 0, threads);
    return 0;
  });
}
