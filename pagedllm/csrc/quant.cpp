// GEMM / GEMV over weights kept in GGUF's quantized block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
// Q5_K, Q6_K), never dequantized to memory: each 32-weight chunk is decoded to 32 int8 in a register and
// multiplied by the activations quantized the same way (per 32 values: scale amax / 127, int8
// values rounded to nearest even, and their sum for the formats with a per-chunk offset), as
// llama.cpp does on CPUs. A chunk's product is one integer dot (vpmaddubsw + vpmaddwd: 32 int8
// products in two instructions, where float32 FMA does 8) scaled by the two chunks' scales.
//
// Two kernels: Q8_0, Q4_0 and Q4_1 (here) and the K-quants Q4_K, Q5_K, Q6_K (quant_k.cpp) repacked at load so
// that one register holds a group of rows' values (below: one scale multiply serves 8 or 16 outputs; vpdpbusd
// at the avx512_bf16 level); Q5_0 and Q5_1, and every format where a matrix is not packed, read as the file has
// them, a row at a time (256-bit code at every level). A decode step reads ~5 bits per weight (Q4_1) instead of
// 16 (bf16), which is what a memory-bound decode step is paid in: SmolLM2-135M's single-sequence decode 105 ->
// 145 tok/s on 2 Zen 4 cores.
//
// Chunk c of a row of K weights (K a multiple of the format's block: 32, or 256 for the K-quants):
//   value j = scale[j / 16 within the chunk] * q[j] + offset, q int8 (signed, or unsigned 0..15 / 0..31).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>
#include "quant.h"

namespace {
using namespace pl;
using namespace pl::quant;

// One decoded chunk: 32 int8 weights, the scales of its two halves, and the offset of every value.
struct Chunk {
  __m256i q;
  float scale_lo, scale_hi, offset;
};

inline __m256i nibbles(__m128i bytes) {  // 16 bytes -> 32 values: the 16 low nibbles, then the 16 high ones
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), m), _mm_and_si128(bytes, m));
}

// 4 bytes of fifth bits (value k: bit k) -> 32 bytes, 0x10 where the bit is set.
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  // byte k takes byte k / 8 of the word (the shuffle works per 128-bit half: both halves hold the word)
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);  // byte k tests bit k % 8
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

template <int QT> struct Format;

template <> struct Format<kQ8_0> {  // d (f16), 32 x int8
  static constexpr int64_t kBlock = 32, kBytes = 34;
  static constexpr bool kUnsigned = false;
  static Chunk decode(const uint8_t* row, int64_t c) {
    const uint8_t* b = row + c * kBytes;
    const float d = half(b);
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), d, d, 0.f};
  }
};

template <> struct Format<kQ4_0> {  // d (f16), 16 bytes of nibbles; value = d * (q - 8)
  static constexpr int64_t kBlock = 32, kBytes = 18;
  static constexpr bool kUnsigned = false;
  static Chunk decode(const uint8_t* row, int64_t c) {
    const uint8_t* b = row + c * kBytes;
    const float d = half(b);
    const __m256i q = nibbles(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
    return {_mm256_sub_epi8(q, _mm256_set1_epi8(8)), d, d, 0.f};
  }
};

template <> struct Format<kQ4_1> {  // d, m (f16), 16 bytes of nibbles; value = d * q + m
  static constexpr int64_t kBlock = 32, kBytes = 20;
  static constexpr bool kUnsigned = true;
  static Chunk decode(const uint8_t* row, int64_t c) {
    const uint8_t* b = row + c * kBytes;
    const float d = half(b);
    return {nibbles(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4))), d, d, half(b + 2)};
  }
};

template <> struct Format<kQ5_0> {  // d (f16), 4 bytes of fifth bits, 16 bytes of nibbles; value = d * (q - 16)
  static constexpr int64_t kBlock = 32, kBytes = 22;
  static constexpr bool kUnsigned = false;
  static Chunk decode(const uint8_t* row, int64_t c) {
    const uint8_t* b = row + c * kBytes;
    const float d = half(b);
    const __m256i q =
        _mm256_or_si256(nibbles(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 6))), fifth_bits(b + 2));
    return {_mm256_sub_epi8(q, _mm256_set1_epi8(16)), d, d, 0.f};
  }
};

template <> struct Format<kQ5_1> {  // d, m (f16), 4 bytes of fifth bits, 16 bytes of nibbles; value = d * q + m
  static constexpr int64_t kBlock = 32, kBytes = 24;
  static constexpr bool kUnsigned = true;
  static Chunk decode(const uint8_t* row, int64_t c) {
    const uint8_t* b = row + c * kBytes;
    const float d = half(b);
    const __m256i q =
        _mm256_or_si256(nibbles(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8))), fifth_bits(b + 4));
    return {q, d, d, half(b + 2)};
  }
};

// Q4_K: super-blocks of 256 = d, dmin (f16), 12 bytes of 6-bit scales and mins for its 8 chunks,
// 128 bytes of nibbles (chunk 2i: the low nibbles of bytes 32i..32i+31, chunk 2i+1 their high ones);
// value = d * scale * q - dmin * min.
template <> struct Format<kQ4_K> {
  static constexpr int64_t kBlock = 256, kBytes = 144;
  static constexpr bool kUnsigned = true;
  static Chunk decode(const uint8_t* row, int64_t c) {
    const uint8_t* b = row + (c / 8) * kBytes;
    const int j = static_cast<int>(c % 8);
    int sc, mn;
    k_scale_min(b + 4, j, sc, mn);
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (j / 2)));
    const __m256i q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0F));
    const float scale = half(b) * sc;
    return {q, scale, scale, -half(b + 2) * mn};
  }
};

// Q5_K: super-blocks of 256 = d, dmin (f16), 12 bytes of scales and mins (as Q4_K), 32 bytes qh of fifth bits
// (chunk j's value l: bit j of qh[l]), 128 bytes of nibbles (as Q4_K's); value = d * scale * q - dmin * min,
// q = nibble + 16 * fifth bit (0..31: a pair of vpmaddubsw products stays under 2 * 31 * 127 < 2^15).
template <> struct Format<kQ5_K> {
  static constexpr int64_t kBlock = 256, kBytes = 176;
  static constexpr bool kUnsigned = true;
  static Chunk decode(const uint8_t* row, int64_t c) {
    const uint8_t* b = row + (c / 8) * kBytes;
    const int j = static_cast<int>(c % 8);
    int sc, mn;
    k_scale_min(b + 4, j, sc, mn);
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * (j / 2)));
    const __m256i low = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0F));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    // bit j of each byte to bit 4 in one 16-bit shift (by at most 4 either way: no bit crosses into the other byte)
    const __m256i moved = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
    const __m256i q = _mm256_or_si256(low, _mm256_and_si256(moved, _mm256_set1_epi8(0x10)));
    const float scale = half(b) * sc;
    return {q, scale, scale, -half(b + 2) * mn};
  }
};

// Q6_K: super-blocks of 256 = 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (one
// per 16 values), d (f16); value = d * scale * (q - 32). In each half of 128 values, chunk p takes
// ql[l + 32 (p & 1)]'s low (p < 2) or high nibble and bits 2p, 2p + 1 of qh[l], l = 0..31.
template <> struct Format<kQ6_K> {
  static constexpr int64_t kBlock = 256, kBytes = 210;
  static constexpr bool kUnsigned = false;
  static Chunk decode(const uint8_t* row, int64_t c) {
    const uint8_t* b = row + (c / 8) * kBytes;
    const int half_i = static_cast<int>(c % 8) / 4, p = static_cast<int>(c % 4);
    const uint8_t* ql = b + 64 * half_i + 32 * (p & 1);
    const uint8_t* qh = b + 128 + 32 * half_i;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * half_i + 2 * p;
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    const __m256i lo = _mm256_and_si256(p < 2 ? l : _mm256_srli_epi16(l, 4), low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(h, 2 * p), low2);
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    const float d = half(b + 208);
    return {q, d * sc[0], d * sc[1], 0.f};
  }
};

// 32 values -> 32 int8 round(v / d) (nearest even, as torch.round), d = amax / 127; returns d, the int sum and
// the first 16 values' sum.
template <typename T>
inline float quantize_chunk(const T* src, int8_t* q, int& sum, int& sum16) {
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < 4; ++i) v[i] = load8(src + 8 * i), amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
  const float d = hmax8(amax) / 127.f;
  const __m256 inv = _mm256_set1_ps(d > 1e-30f ? 1.f / d : 0.f);  // a block of ~0 (1 / d would be inf): zeros
  __m256i n[4];
  for (int i = 0; i < 4; ++i)
    n[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i first = _mm256_add_epi32(n[0], n[1]);
  sum16 = hsum8_i32(first);
  sum = sum16 + hsum8_i32(_mm256_add_epi32(n[2], n[3]));
  // packs work per 128-bit half: 4-byte groups come out as values 0-3 of n[0..3], then values 4-7 of each;
  // the permute puts each vector's two groups together
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  return d;
}

template <typename T>
void quantize_rows(const T* x, int64_t lda, int64_t M, int64_t K, QRow& out, int threads) {
  const int64_t chunks = K / 32;
  out.q.resize(M * K);
  out.sum.resize(M * chunks);
  out.sum16.resize(M * chunks);
  out.d.resize(M * chunks);
  out.s.resize(M * chunks);
  parallel_for(M * chunks, threads, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / chunks, c = i % chunks;
      int sum, sum16;
      const float d = quantize_chunk(x + r * lda + c * 32, out.q.data() + r * K + c * 32, sum, sum16);
      out.sum[i] = sum;
      out.sum16[i] = sum16;
      out.d[i] = d;
      out.s[i] = d * static_cast<float>(sum);
    }
  });
}

// 8 int32 sums of 4 products each: lanes 0-3 cover values 0-15, lanes 4-7 values 16-31.
template <bool kUnsigned>
inline __m256i dot32(__m256i w, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kUnsigned) return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
  // signed x signed: |w| as the unsigned operand, x carrying w's sign
  return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
}

// MR rows x NC output features, every chunk of K.
template <int QT, int MR, int NC, typename T>
void tile(const QRow& xq, int64_t m0, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t K, T* out, int64_t ldc) {
  using F = Format<QT>;
  const int64_t chunks = K / 32;
  __m256 acc[MR][NC];
  float off[MR][NC];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NC; ++n) acc[r][n] = _mm256_setzero_ps(), off[r][n] = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    Chunk ch[NC];
    for (int n = 0; n < NC; ++n) ch[n] = F::decode(w + (n0 + n) * row_bytes, c);
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * chunks + c;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + (m0 + r) * K + c * 32));
      const float dx = xq.d[i];
      for (int n = 0; n < NC; ++n) {
        const __m256 scale = _mm256_set_m128(_mm_set1_ps(ch[n].scale_hi * dx), _mm_set1_ps(ch[n].scale_lo * dx));
        acc[r][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32<F::kUnsigned>(ch[n].q, x)), scale, acc[r][n]);
        if (F::kUnsigned) off[r][n] += ch[n].offset * xq.s[i];
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NC; ++n) out[(m0 + r) * ldc + n0 + n] = from_f32<T>(hsum8(acc[r][n]) + off[r][n]);
}

template <int QT, int MR, typename T>
void tile_cols(int nc, const QRow& xq, int64_t m0, const uint8_t* w, int64_t rb, int64_t n0, int64_t K, T* out,
               int64_t ldc) {
  switch (nc) {
    case 1: tile<QT, MR, 1>(xq, m0, w, rb, n0, K, out, ldc); break;
    case 2: tile<QT, MR, 2>(xq, m0, w, rb, n0, K, out, ldc); break;
    case 3: tile<QT, MR, 3>(xq, m0, w, rb, n0, K, out, ldc); break;
    default: tile<QT, MR, 4>(xq, m0, w, rb, n0, K, out, ldc); break;
  }
}

constexpr int64_t kCols = 16;  // output features per unit of work: their weights stay in L1 across row tiles

// out (M, N; row stride ldc) = x (M, K, quantized in q) W^T, W (N rows of row_bytes) in format QT as
// the file has it (Q5_0 and Q5_1; the other formats where a matrix is not packed: the tests, a Q8_0 scale the
// packed layout cannot hold).
template <int QT, typename T>
void rows_gemm(const QRow& q, const uint8_t* w, T* out, int64_t ldc, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t row_bytes = K / Format<QT>::kBlock * Format<QT>::kBytes;
  const int64_t col_units = (N + kCols - 1) / kCols, row_units = (M + kRows - 1) / kRows;
  parallel_for(col_units * row_units, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t m0 = (u / col_units) * kRows, n0 = (u % col_units) * kCols;
      const int64_t m1 = std::min(M, m0 + kRows), n1 = std::min(N, n0 + kCols);
      // 4 rows x 2 features: 8 accumulators, 2 decoded chunks and a row of x in 16 registers
      const int64_t full = m0 + (m1 - m0) / 4 * 4;
      for (int64_t n = n0; n < n1; n += 2)
        for (int64_t m = m0; m < full; m += 4)
          tile_cols<QT, 4>(static_cast<int>(std::min<int64_t>(2, n1 - n)), q, m, w, row_bytes, n, K, out, ldc);
      // the last 1-3 rows (all of a decode step's one row): 4 features at a time, 4 independent sums
      for (int64_t n = n0; n < n1; n += 4)
        for (int64_t m = full; m < m1; ++m)
          tile_cols<QT, 1>(static_cast<int>(std::min<int64_t>(4, n1 - n)), q, m, w, row_bytes, n, K, out, ldc);
    }
  });
}

// ------------------------------------------------------------------ packed layout (Q4_0, Q4_1, Q8_0)
// Packed once at load: rows in groups of kGroup (quant.h: 8 with 256-bit registers, 16 with AVX-512's), and
// per (group, chunk of 32) the group's scales and offsets as f16 vectors, then their values with 4
// consecutive k of a row side by side: 4 * kGroup bytes hold "quad" t (k = 4t..4t+3) of all the
// group's rows. One broadcast of x's quad t against them gives the group's kGroup partial sums in
// one register (vpdpbusd, or vpmaddubsw + vpmaddwd): the scale multiply, the f16 conversions and the
// int -> float conversion serve kGroup outputs at a time, not one. 4-bit values are stored as
// nibbles (register s: low nibbles quad 2s, high nibbles quad 2s + 1), unsigned with the format's
// zero point folded into the offset (Q4_0: value = d u - 8 d, u in 0..15); Q8_0 likewise where VNNI runs it
// (kQ8Unsigned), signed with no offset below. The layout depends on the level: a weight is packed by the
// kernels that run it.
// Q8_0 with VNNI is stored unsigned, u = q + 128 with offset -128 d (as Q4_0's zero point): one vpdpbusd a quad,
// where signed values take two more operations to move w's sign onto x. vpmaddubsw cannot take it (a pair of
// 255 x 127 saturates int16), so below VNNI Q8_0 stays signed.
constexpr bool kQ8Unsigned = kVnni;

template <int QT> struct Packed {  // Q4_0, Q4_1: f16 scales, f16 offsets, 16 kGroup bytes of nibbles
  static constexpr bool kOffsets = true;
  static constexpr int64_t kValues = 2 * kGroup + 2 * kGroup;  // where the values start
  static constexpr int64_t kChunkBytes = kValues + 16 * kGroup;
};
template <> struct Packed<kQ8_0> {  // f16 scales, (kQ8Unsigned: f16 offsets,) 32 kGroup bytes of int8 / uint8
  static constexpr bool kOffsets = kQ8Unsigned;
  static constexpr int64_t kValues = (kOffsets ? 4 : 2) * kGroup;
  static constexpr int64_t kChunkBytes = kValues + 32 * kGroup;
};
template <int QT> constexpr bool kPackable = QT == kQ4_0 || QT == kQ4_1 || QT == kQ8_0;
template <int QT> constexpr bool kKPacked = QT == kQ4_K || QT == kQ5_K || QT == kQ6_K;  // packed by quant_k.cpp
// Formats whose offset is a fixed zero point, value = d (u - zp): with VNNI the kernel folds it into the integer
// sum (u . x - zp sum(x), exact in int32: |sum| < 2^21) instead of a float multiply-add a chunk. Below VNNI the
// chunk's int16 sums leave no room for it, and the stored offset (-zp d, exact in f16) is added as for Q4_1.
template <int QT> constexpr int kZeroPoint = QT == kQ4_0 ? 8 : QT == kQ8_0 && kQ8Unsigned ? 128 : 0;
template <int QT> constexpr bool kIntOffset = kVnni && kZeroPoint<QT> != 0;

template <int QT>
int64_t packed_bytes(int64_t N, int64_t K) {
  return (N + kGroup - 1) / kGroup * (K / 32) * Packed<QT>::kChunkBytes;
}

// Where value k (0..31) of row j of a group sits among a packed chunk's values (4-bit: its byte).
inline int64_t packed_pos(int QT, int j, int k) {
  const int t = k / 4, b = k % 4;
  return (QT == kQ8_0 ? t : t / 2) * kQuad + 4 * j + b;
}

template <int QT>
int pack(const uint8_t* raw, uint8_t* out, int64_t N, int64_t K, int threads) {
  using F = Format<QT>;
  using P = Packed<QT>;
  const int64_t chunks = K / 32, row_bytes = K / F::kBlock * F::kBytes;
  const int64_t groups = (N + kGroup - 1) / kGroup;
  std::atomic<bool> overflow{false};
  parallel_for(groups * chunks, threads, 64, [&](int64_t begin, int64_t end) {
    alignas(32) int8_t q[kGroup][32];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / chunks, c = i % chunks;
      uint8_t* dst = out + i * P::kChunkBytes;
      uint16_t scales[kGroup], offsets[kGroup];
      for (int j = 0; j < kGroup; ++j) {
        const int64_t n = g * kGroup + j;
        float scale = 0.f, offset = 0.f;
        if (n < N) {
          const Chunk ch = F::decode(raw + n * row_bytes, c);
          _mm256_store_si256(reinterpret_cast<__m256i*>(q[j]), ch.q);
          scale = ch.scale_lo, offset = ch.offset;
          if (QT == kQ4_0) {  // back to unsigned 0..15: value = d (u - 8) = d u - 8 d (exact in f16)
            for (int k = 0; k < 32; ++k) q[j][k] = static_cast<int8_t>(q[j][k] + 8);
            offset = -8.f * scale;
          } else if (QT == kQ8_0 && kQ8Unsigned) {  // -128..127 -> 0..255: value = d (u - 128) = d u - 128 d
            for (int k = 0; k < 32; ++k) q[j][k] = static_cast<int8_t>(static_cast<uint8_t>(q[j][k]) ^ 0x80);
            offset = -128.f * scale;
            if (std::abs(offset) > 65504.f) overflow = true;  // past f16's range (|d| > 511)
          }
        } else {
          std::memset(q[j], 0, 32);  // rows past N: zero weights
        }
        scales[j] = _cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT);
        offsets[j] = _cvtss_sh(offset, _MM_FROUND_TO_NEAREST_INT);
      }
      std::memcpy(dst, scales, 2 * kGroup);
      if (P::kOffsets) std::memcpy(dst + 2 * kGroup, offsets, 2 * kGroup);
      uint8_t* values = dst + P::kValues;
      std::memset(values, 0, P::kChunkBytes - P::kValues);
      for (int j = 0; j < kGroup; ++j)
        for (int k = 0; k < 32; ++k) {
          const uint8_t v = static_cast<uint8_t>(q[j][k]);
          uint8_t& byte = values[packed_pos(QT, j, k)];
          byte = QT == kQ8_0 ? v : static_cast<uint8_t>(byte | ((k / 4) % 2 ? v << 4 : v));  // odd quads: high nibbles
        }
    }
  });
  return overflow ? 1 : 0;  // 1: a Q8_0 scale beyond 511 whose offset (-128 d) f16 cannot hold: not packed
}

// MR rows of x x G groups of kGroup output features, every chunk of K.
// On Intel (stream_prefetch, quant.h) each group's stream is read kAheadBytes ahead with software prefetches, as the
// K-quant tile does (quant_k.cpp): at the sizes people serve the weights stream from memory every step and the
// hardware prefetchers alone keep too few lines in flight there. 4.5 KiB (two Q4_K super-blocks of a 16-row group):
// 1-row GEMV medians on the 2-core AMX Xeon, 2048x8192 and 8192x2048, cold, two alternating rounds: Q4_1 9-25% and Q8_0
// -2 to 17% faster than none; 2.25 KiB and 9 KiB gained less (benchmarks/quant_kernels.py --cold).
constexpr int64_t kAheadBytes = 4608;
template <int QT, int MR, int G, typename T>
void packed_tile(const QRow& xq, int64_t m0, const uint8_t* w, int64_t group_bytes, int64_t g0, int64_t N, int64_t K,
                 T* out, int64_t ldc) {
  using P = Packed<QT>;
  const int64_t chunks = K / 32;
  V acc[MR][G];
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = vzero();
  constexpr int64_t kAhead = (kAheadBytes + P::kChunkBytes - 1) / P::kChunkBytes;  // chunks ahead
  const int64_t prefetch_until = stream_prefetch() ? chunks - kAhead : 0;
  for (int64_t c = 0; c < chunks; ++c) {
    if (c < prefetch_until)  // (the group's own stream only)
      for (int g = 0; g < G; ++g)
        for (int64_t off = 0; off < P::kChunkBytes; off += 64)
          __builtin_prefetch(w + (g0 + g) * group_bytes + (c + kAhead) * P::kChunkBytes + off, 0, 3);
    VI isum[MR][G];
    for (int r = 0; r < MR; ++r) {
      const VI start = kIntOffset<QT> ? vi_bcast(-kZeroPoint<QT> * xq.sum[(m0 + r) * chunks + c]) : vi_zero();
      for (int g = 0; g < G; ++g) isum[r][g] = start;
    }
    const int32_t* xs[MR];
    for (int r = 0; r < MR; ++r) xs[r] = reinterpret_cast<const int32_t*>(xq.q.data() + (m0 + r) * K + c * 32);
    const uint8_t* v[G];
    for (int g = 0; g < G; ++g) v[g] = w + (g0 + g) * group_bytes + c * P::kChunkBytes + P::kValues;
    if constexpr (QT == kQ8_0 && kQ8Unsigned) {
      for (int t = 0; t < 8; ++t) {
        VI u[G];
        for (int g = 0; g < G; ++g) u[g] = vi_load(v[g] + kQuad * t);
        for (int r = 0; r < MR; ++r) {
          const VI x = vi_bcast(xs[r][t]);
          for (int g = 0; g < G; ++g) isum[r][g] = vi_dot(isum[r][g], u[g], x);
        }
      }
    } else if constexpr (QT == kQ8_0) {
      for (int t = 0; t < 8; ++t) {
        VI s[G], u[G];
        for (int g = 0; g < G; ++g) s[g] = vi_load(v[g] + kQuad * t), u[g] = vi_abs8(s[g]);  // |w|, x gets w's sign
        for (int r = 0; r < MR; ++r) {
          const VI x = vi_bcast(xs[r][t]);  // one broadcast for every group
          for (int g = 0; g < G; ++g) isum[r][g] = vi_dot(isum[r][g], u[g], vi_sign8(x, s[g]));
        }
      }
    } else {
      const VI low = vi_set1_8(0x0F);
      for (int t = 0; t < 8; t += 2) {
        VI lo[G], hi[G];
        for (int g = 0; g < G; ++g) {
          const VI b = vi_load(v[g] + kQuad * (t / 2));
          lo[g] = vi_and(b, low), hi[g] = vi_high_nibbles(b);
        }
        for (int r = 0; r < MR; ++r) {
          const VI xl = vi_bcast(xs[r][t]), xh = vi_bcast(xs[r][t + 1]);
          for (int g = 0; g < G; ++g) {
            if constexpr (kVnni) isum[r][g] = vi_dot(vi_dot(isum[r][g], lo[g], xl), hi[g], xh);
            else isum[r][g] = vi_dot16(vi_dot16(isum[r][g], lo[g], xl), hi[g], xh);
          }
        }
      }
      // without VNNI the chunk is summed in int16 pairs, widened once: |pair| <= 2 * 15 * 127 = 3810, and 8
      // quads' sum <= 30480 < 2^15 (x is within +-127); one vpmaddwd a chunk instead of one a quad
      if constexpr (!kVnni)
        for (int r = 0; r < MR; ++r)
          for (int g = 0; g < G; ++g) isum[r][g] = vi_widen(isum[r][g]);
    }
    for (int g = 0; g < G; ++g) {
      const uint8_t* head = w + (g0 + g) * group_bytes + c * P::kChunkBytes;
      const V scale = vload(reinterpret_cast<const f16*>(head));
      constexpr bool kFloatOffset = P::kOffsets && !kIntOffset<QT>;
      const V offset = kFloatOffset ? vload(reinterpret_cast<const f16*>(head + 2 * kGroup)) : vzero();
      for (int r = 0; r < MR; ++r) {
        const int64_t i = (m0 + r) * chunks + c;
        acc[r][g] = vfma(vcvt_i32(isum[r][g]), vmul(scale, vset1(xq.d[i])), acc[r][g]);
        if (kFloatOffset) acc[r][g] = vfma(offset, vset1(xq.s[i]), acc[r][g]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < G; ++g) {  // one vector store a group (a 256-row LM head writes 12.6 M outputs a step)
      const int64_t n0 = (g0 + g) * kGroup;
      T* dst = out + (m0 + r) * ldc + n0;
      if (n0 + kGroup <= N) vstore(dst, acc[r][g]);
      else vstore_n(dst, acc[r][g], static_cast<int>(N - n0));
    }
}

template <int QT, typename T>
void packed_gemm(const QRow& q, const uint8_t* w, T* out, int64_t ldc, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t groups = (N + kGroup - 1) / kGroup, group_bytes = (K / 32) * Packed<QT>::kChunkBytes;
  packed_units(M, groups, threads, [&](auto mr, auto gs, int64_t m, int64_t g) {
    packed_tile<QT, decltype(mr)::value, decltype(gs)::value>(q, m, w, group_bytes, g, N, K, out, ldc);
  });
}

template <typename Fn>
int with_qtype(int qtype, const Fn& fn) {
  switch (qtype) {
    case kQ8_0: return fn(std::integral_constant<int, kQ8_0>{});
    case kQ4_0: return fn(std::integral_constant<int, kQ4_0>{});
    case kQ4_1: return fn(std::integral_constant<int, kQ4_1>{});
    case kQ5_0: return fn(std::integral_constant<int, kQ5_0>{});
    case kQ5_1: return fn(std::integral_constant<int, kQ5_1>{});
    case kQ4_K: return fn(std::integral_constant<int, kQ4_K>{});
    case kQ5_K: return fn(std::integral_constant<int, kQ5_K>{});
    case kQ6_K: return fn(std::integral_constant<int, kQ6_K>{});
    default: set_error("quantized type %d is not supported by the kernels", qtype); return -1;
  }
}
}  // namespace

// Block size and bytes per block of GGML type `qtype`, and whether pl_qpack packs it (0: the kernels
// read its rows as the file has them).
PL_EXPORT int pl_qtype_layout(int qtype, int64_t* block, int64_t* bytes, int* packs) {
  *block = 0, *bytes = 0, *packs = 0;
  return with_qtype(qtype, [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    *block = Format<QT>::kBlock, *bytes = Format<QT>::kBytes, *packs = kPackable<QT> || kKPacked<QT>;
    return 0;
  });
}

// Bytes of the packed copy of an (N, K) matrix of a packable type.
PL_EXPORT int64_t pl_qpack_size(int qtype, int64_t N, int64_t K) {
  int64_t size = -1;
  with_qtype(qtype, [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    if constexpr (kPackable<QT>) size = packed_bytes<QT>(N, K);
    if constexpr (kKPacked<QT>) size = k_packed_bytes(QT, N, K);
    return 0;
  });
  return size;
}

// (N, K) matrix as the file has it -> the packed copy (pl_qpack_size bytes) pl_qgemm reads with packed = 1.
// Returns 1 where a value does not fit the packed layout (then `out` is not to be used: run the rows as they are).
PL_EXPORT int pl_qpack(const void* raw, void* out, int64_t N, int64_t K, int qtype, int threads) {
  return with_qtype(qtype, [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    if (K % Format<QT>::kBlock) {
      set_error("in_features %lld is not a multiple of the format's block of %lld", static_cast<long long>(K),
                static_cast<long long>(Format<QT>::kBlock));
      return -1;
    }
    if constexpr (kPackable<QT>) {
      return pack<QT>(static_cast<const uint8_t*>(raw), static_cast<uint8_t*>(out), N, K, threads);
    } else if constexpr (kKPacked<QT>) {
      k_pack(QT, static_cast<const uint8_t*>(raw), static_cast<uint8_t*>(out), N, K, threads);
      return 0;
    } else {
      set_error("quantized type %d is not packed", qtype);
      return -1;
    }
  });
}

// out (M, N; row stride ldc) = x (M, K; row stride lda) W^T with W (N, K) in GGML type qtype: rows of
// K / block * bytes bytes as the file has them (packed = 0), or pl_qpack's copy (packed = 1); x and out of
// storage dtype `dtype`.
PL_EXPORT int pl_qgemm(const void* x, int64_t lda, const void* w, int packed, void* out, int64_t ldc, int64_t M,
                       int64_t N, int64_t K, int qtype, int dtype, int threads) {
  if (M == 0 || N == 0) return 0;
  return with_qtype(qtype, [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    if (K % Format<QT>::kBlock) {
      set_error("in_features %lld is not a multiple of the format's block of %lld", static_cast<long long>(K),
                static_cast<long long>(Format<QT>::kBlock));
      return -1;
    }
    if (packed && !kPackable<QT> && !kKPacked<QT>) {
      set_error("quantized type %d is not packed", qtype);
      return -1;
    }
    return with_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      thread_local QRow xq;  // the calling thread's buffer, read by every worker
      quantize_rows(static_cast<const T*>(x), lda, M, K, xq, threads);
      const uint8_t* wb = static_cast<const uint8_t*>(w);
      bool done = false;
      if constexpr (kPackable<QT>) {
        if (packed) packed_gemm<QT, T>(xq, wb, static_cast<T*>(out), ldc, M, N, K, threads), done = true;
      }
      if constexpr (kKPacked<QT>) {
        if (packed) k_packed_gemm<T>(QT, xq, wb, static_cast<T*>(out), ldc, M, N, K, threads), done = true;
      }
      if (!done) rows_gemm<QT, T>(xq, wb, static_cast<T*>(out), ldc, M, N, K, threads);
      if (xq.q.capacity() > (size_t{1} << 24)) xq = QRow{};  // a long prompt's 16+ MiB: not held for good
      return 0;
    });
  });
}

// Row n, chunk c of a packed matrix as 32 floats.
template <int QT>
void packed_chunk(const uint8_t* w, int64_t n, int64_t c, int64_t K, float* y) {
  using P = Packed<QT>;
  const uint8_t* head = w + (n / kGroup) * (K / 32) * P::kChunkBytes + c * P::kChunkBytes;
  const int j = static_cast<int>(n % kGroup);
  const float scale = half(head + 2 * j), offset = P::kOffsets ? half(head + 2 * kGroup + 2 * j) : 0.f;
  const uint8_t* v = head + P::kValues;
  for (int k = 0; k < 32; ++k) {
    const uint8_t byte = v[packed_pos(QT, j, k)];
    const float q = QT != kQ8_0   ? static_cast<float>((k / 4) % 2 ? byte >> 4 : byte & 0x0F)
                    : kQ8Unsigned ? static_cast<float>(byte)
                                  : static_cast<float>(static_cast<int8_t>(byte));
    y[k] = scale * q + offset;
  }
}

// out (M, K) = rows ids[0..M) of the quantized (rows, K) table (as the file has it, or packed), dequantized:
// an embedding lookup.
PL_EXPORT int pl_qrows(const void* w, int packed, const int64_t* ids, int64_t M, int64_t rows, int64_t K, int qtype,
                       void* out, int dtype, int threads) {
  for (int64_t i = 0; i < M; ++i)
    if (ids[i] < 0 || ids[i] >= rows) {
      set_error("row %lld outside the table of %lld rows", static_cast<long long>(ids[i]),
                static_cast<long long>(rows));
      return -1;
    }
  return with_qtype(qtype, [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    using F = Format<QT>;
    if (K % F::kBlock || (packed && !kPackable<QT> && !kKPacked<QT>)) {
      set_error("a table of type %d cannot have %lld columns%s", qtype, static_cast<long long>(K),
                packed ? " or be packed" : "");
      return -1;
    }
    const int64_t row_bytes = K / F::kBlock * F::kBytes;
    const uint8_t* wb = static_cast<const uint8_t*>(w);
    return with_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      parallel_for(M, threads, 16, [&](int64_t begin, int64_t end) {
        alignas(32) int8_t q[32];
        float y[32];
        for (int64_t i = begin; i < end; ++i) {
          T* dst = static_cast<T*>(out) + i * K;
          for (int64_t c = 0; c < K / 32; ++c) {
            bool done = false;
            if constexpr (kPackable<QT>) {
              if (packed) packed_chunk<QT>(wb, ids[i], c, K, y), done = true;
            }
            if constexpr (kKPacked<QT>) {
              if (packed) k_packed_chunk(QT, wb, ids[i], c, K, y), done = true;
            }
            if (!done) {
              const Chunk ch = F::decode(wb + ids[i] * row_bytes, c);
              _mm256_store_si256(reinterpret_cast<__m256i*>(q), ch.q);
              for (int j = 0; j < 32; ++j) {
                const float v =
                    F::kUnsigned ? static_cast<float>(static_cast<uint8_t>(q[j])) : static_cast<float>(q[j]);
                y[j] = (j < 16 ? ch.scale_lo : ch.scale_hi) * v + ch.offset;
              }
            }
            for (int j = 0; j < 32; ++j) dst[c * 32 + j] = from_f32<T>(y[j]);
          }
        }
      });
      return 0;
    });
  });
}
