// Shared AVX-512 helpers of the fused ops and the GEMM: bf16 <-> float32 lanes, and exp().
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace pagedllm_simd {
using bf16 = uint16_t;

inline __m512 load_bf16(const bf16* p, __mmask16 m) {  // 16 bf16 -> 16 float32 (bf16 is the top half of a float)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 round_bf16(__m512 x) {  // float32 -> nearest-even bf16 -> float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
inline void store_bf16(bf16* p, __m512 x, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x)); }
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

// exp(x) for float32 lanes: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2; scalef handles over/underflow.
inline __m512 exp_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 split in two for precision
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);  // Taylor series to r^7: error < 1 ulp over |r| <= 0.347
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// sum(x^2) over a bf16 row, added in the order torch's CPU sum kernel uses for a contiguous row of
// float32 (8-lane vectors, 4 interleaved accumulators, cascade levels of 16, the lanes added last),
// so the norm rounds exactly as transformers' ``h.pow(2).mean(-1)`` does, bit for bit.
inline float sum_squares_torch_order(const bf16* x, int64_t n) {
  auto sq8 = [x](int64_t v) {
    const __m256 h = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(x + 8 * v))), 16));
    return _mm256_mul_ps(h, h);  // rounded before the add, as pow(2) then sum (built with -ffp-contract=off)
  };
  const int64_t nv = n / 8, size = nv / 4;
  int64_t log2 = 0;
  while ((int64_t(1) << log2) < size) ++log2;
  const int64_t power = std::max<int64_t>(4, log2 / 4), step = int64_t(1) << power, mask = step - 1;
  __m256 acc[4][4];
  for (auto& level : acc) for (auto& a : level) a = _mm256_setzero_ps();
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], sq8(4 * i + k));
    for (int j = 1; j < 4; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if (i & (mask << (j * power))) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], sq8(4 * i + k));
  for (int j = 1; j < 4; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
  for (int64_t v = size * 4; v < nv; ++v) acc[0][0] = _mm256_add_ps(acc[0][0], sq8(v));
  for (int k = 1; k < 4; ++k) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
  float total = 0.f;
  for (int64_t d = nv * 8; d < n; ++d) {  // the tail first, then the lanes, one by one
    const float h = at::BFloat16(x[d], at::BFloat16::from_bits());
    total += h * h;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc[0][0]);
  for (float lane : lanes) total += lane;
  return total;
}

// silu(g) = g / (1 + exp(-g)) with float32 lanes, rounded to bf16 as torch's F.silu output is.
inline __m512 silu_bf16(__m512 g) {
  return round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
}
}  // namespace pagedllm_simd
