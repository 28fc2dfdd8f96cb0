// One vector type for the kernels, built once per instruction-set level.
//
// The library is compiled once per level (pagedllm/platform/build.py): -mavx2 -mfma -mf16c for
// "avx2" (V = 8 float32 lanes in a ymm register), plus AVX-512 F/BW/VL/DQ for "avx512" (16 lanes
// in a zmm register), plus AVX512-BF16 and VNNI for "avx512_bf16". A kernel written against V,
// vload and vstore runs at every level; nothing here uses an instruction the level's flags do not
// enable. This header is the kernels' one vector layer: beside V, the 8-lane ymm helpers (load8,
// hsum8, ...) for code that is 256 bits wide at every level, and VI, V's integer counterpart for
// int8 dot products (the quantized GEMM). Kernel files define no vector primitives of their own,
// only their formats' decoding and their tiles.
//
// Storage types: float, bf16 (the top half of a float32; round to nearest even on store, as
// torch's c10::BFloat16 does) and f16 (IEEE half, F16C conversions). Arithmetic is float32.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the kernels need at least AVX2, FMA and F16C (the avx2 level)"
#endif

namespace pl {

struct bf16 {
  uint16_t x;
};
struct f16 {
  uint16_t x;
};

// ----------------------------------------------------------------------------- scalars
inline float to_f32(float v) { return v; }
inline float to_f32(bf16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_f32(f16 v) { return _cvtsh_ss(v.x); }

inline uint16_t bf16_bits(float f) {  // round to nearest even; NaN -> quiet NaN (c10::BFloat16's rule)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

template <typename T> inline T from_f32(float f);
template <> inline float from_f32<float>(float f) { return f; }
template <> inline bf16 from_f32<bf16>(float f) { return bf16{bf16_bits(f)}; }
template <> inline f16 from_f32<f16>(float f) {
  return f16{static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
}

// ----------------------------------------------------------------------------- 8 float32 lanes
// One ymm register at every level: for code whose layout is 256 bits wide whatever the level (the
// quantized row kernel, torch's 8-lane summation order). The avx2 level's V is this vector.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const f16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float hsum8(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline float hmax8(__m256 a) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
inline int32_t hsum8_i32(__m256i a) {  // the 8 int32 lanes' sum
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}

// ----------------------------------------------------------------------------- vectors
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define PL_AVX512 1
constexpr int kLanes = 16;
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float f) { return _mm512_set1_ps(f); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline float vsum(V a) { return _mm512_reduce_add_ps(a); }
inline float vmaxval(V a) { return _mm512_reduce_max_ps(a); }
inline V vfloor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline V vround(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m512i vcast_i(V a) { return _mm512_castps_si512(a); }
inline V vcast_f(__m512i a) { return _mm512_castsi512_ps(a); }
inline V vpow2i(V n) {  // 2^n for integral n in [-126, 127]
  return vcast_f(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}

inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline V vload(const bf16* p) {
  return vcast_f(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline V vload(const f16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline V vload(const int8_t* p) {  // 16 signed bytes as float32 lanes (int8 KV cache)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
// v's bits rounded to nearest even at bit 16 (NaN aside): the bf16 bits in the top half of each lane
inline __m512i bf16_rne(V v) {
  const __m512i u = vcast_i(v);
  const __m512i bias =
      _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
  return _mm512_add_epi32(u, bias);
}
inline __m256i bf16_pack(V v) {  // 16 float32 -> 16 bf16 bits, nearest even, NaN -> 0x7FC0
  __m512i r = _mm512_srli_epi32(bf16_rne(v), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
inline void vstore(bf16* p, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_pack(v)); }
inline void vstore(f16* p, V v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// the first n lanes (n < kLanes), the rest `fill`
inline __mmask16 lane_mask(int n) { return static_cast<__mmask16>((1u << n) - 1); }
// v, with 0 in the lanes where x < bound
inline V vzero_below(V v, V x, float bound) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(bound), _CMP_GE_OQ), v);
}
// x in the lanes i with from <= i < to, `fill` in the others
inline V vkeep_range(V x, int64_t from, int64_t to, float fill) {
  const int lo = static_cast<int>(std::clamp<int64_t>(from, 0, kLanes));
  const int hi = static_cast<int>(std::clamp<int64_t>(to, 0, kLanes));
  return _mm512_mask_blend_ps(static_cast<__mmask16>(lane_mask(hi) & ~lane_mask(lo)), vset1(fill), x);
}
inline V vload_n(const float* p, int n, float fill = 0.f) { return _mm512_mask_loadu_ps(vset1(fill), lane_mask(n), p); }
template <typename T>
inline V vload_n(const T* p, int n, float fill = 0.f) {
  const __m256i h = _mm256_maskz_loadu_epi16(lane_mask(n), p);
  V v = std::is_same<T, bf16>::value ? vcast_f(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
  return _mm512_mask_blend_ps(lane_mask(n), vset1(fill), v);
}
inline void vstore_n(float* p, V v, int n) { _mm512_mask_storeu_ps(p, lane_mask(n), v); }
inline void vstore_n(bf16* p, V v, int n) { _mm256_mask_storeu_epi16(p, lane_mask(n), bf16_pack(v)); }
inline void vstore_n(f16* p, V v, int n) {
  _mm256_mask_storeu_epi16(p, lane_mask(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// 2 * kLanes bf16 values at p: the even-indexed ones and the odd-indexed ones as float32 lanes
inline void vload_split(const bf16* p, V& even, V& odd) {
  const __m512i w = _mm512_loadu_si512(p);
  even = vcast_f(_mm512_slli_epi32(w, 16));
  odd = vcast_f(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
// lanes a0 b0 a1 b1 ... a15 b15 (as 32 floats) from the even/odd vectors a, b: inverse of a split
inline void vinterleave(V a, V b, V& lo, V& hi) {
  const __m512i i_lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i i_hi = _mm512_add_epi32(i_lo, _mm512_set1_epi32(8));
  lo = _mm512_permutex2var_ps(a, i_lo, b);
  hi = _mm512_permutex2var_ps(a, i_hi, b);
}
// the even and odd lanes of the 2 * kLanes floats a (lanes 0-15) and b (16-31), in order
inline void vdeinterleave(V a, V b, V& even, V& odd) {
  const __m512i i_even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  even = _mm512_permutex2var_ps(a, i_even, b);
  odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(i_even, _mm512_set1_epi32(1)), b);
}
// r[0..15] as a 16 x 16 matrix of 32-bit lanes, transposed in place (64 shuffles)
inline void vtranspose(V* r) {
  V t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane k: r[2i][4k], r[2i+1][4k], r[2i][4k+1], r[2i+1][4k+1] | ...
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], 128-bit lane k: column 4k + c of rows 4i .. 4i + 3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int c = 0; c < 4; ++c) {  // the 4 x 4 transpose of 128-bit lanes among u[c], u[4 + c], u[8 + c], u[12 + c]
    const V v0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const V v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44), v3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(v1, v3, 0xDD);
  }
}
#else
constexpr int kLanes = 8;
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float f) { return _mm256_set1_ps(f); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm256_min_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(V a) { return hsum8(a); }
inline float vmaxval(V a) { return hmax8(a); }
inline V vfloor(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
inline V vround(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m256i vcast_i(V a) { return _mm256_castps_si256(a); }
inline V vcast_f(__m256i a) { return _mm256_castsi256_ps(a); }
inline V vpow2i(V n) {
  return vcast_f(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

inline V vload(const float* p) { return load8(p); }
inline V vload(const bf16* p) { return load8(p); }
inline V vload(const f16* p) { return load8(p); }
inline V vload(const int8_t* p) {  // 8 signed bytes as float32 lanes (int8 KV cache)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline __m256i bf16_rne(V v) {
  const __m256i u = vcast_i(v);
  const __m256i bias =
      _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
  return _mm256_add_epi32(u, bias);
}
inline __m128i bf16_pack(V v) {  // 8 float32 -> 8 bf16 bits, nearest even, NaN -> 0x7FC0
  __m256i r = _mm256_srli_epi32(bf16_rne(v), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), vcast_i(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // 32-bit lanes hold values < 2^16: pack them to 16 bits (packus works per 128-bit half)
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline void vstore(bf16* p, V v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_pack(v)); }
inline void vstore(f16* p, V v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// partial vectors go through a small buffer: AVX2 has no masked 16-bit loads
template <typename T>
inline V vload_n(const T* p, int n, float fill = 0.f) {
  alignas(32) T buf[kLanes];
  for (int i = 0; i < kLanes; ++i) buf[i] = i < n ? p[i] : from_f32<T>(fill);
  return vload(buf);
}
template <typename T>
inline void vstore_n(T* p, V v, int n) {
  alignas(32) T buf[kLanes];
  vstore(buf, v);
  for (int i = 0; i < n; ++i) p[i] = buf[i];
}
// v, with 0 in the lanes where x < bound
inline V vzero_below(V v, V x, float bound) { return _mm256_and_ps(v, _mm256_cmp_ps(x, vset1(bound), _CMP_GE_OQ)); }
// x in the lanes i with from <= i < to, `fill` in the others
inline V vkeep_range(V x, int64_t from, int64_t to, float fill) {
  const V i = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const V lo = vset1(static_cast<float>(std::clamp<int64_t>(from, -1, kLanes + 1)));
  const V hi = vset1(static_cast<float>(std::clamp<int64_t>(to, -1, kLanes + 1)));
  const V keep = _mm256_and_ps(_mm256_cmp_ps(i, lo, _CMP_GE_OQ), _mm256_cmp_ps(i, hi, _CMP_LT_OQ));
  return _mm256_blendv_ps(vset1(fill), x, keep);
}
inline void vload_split(const bf16* p, V& even, V& odd) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = vcast_f(_mm256_slli_epi32(w, 16));
  odd = vcast_f(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void vinterleave(V a, V b, V& lo, V& hi) {
  const V l = _mm256_unpacklo_ps(a, b), h = _mm256_unpackhi_ps(a, b);  // per 128-bit half: a0 b0 a1 b1 | a4 b4 a5 b5
  lo = _mm256_permute2f128_ps(l, h, 0x20);
  hi = _mm256_permute2f128_ps(l, h, 0x31);
}
inline void vdeinterleave(V a, V b, V& even, V& odd) {
  // shuffle_ps works per 128-bit half: lanes come out as pairs 0 1 4 5 2 3 6 7; permute4x64 fixes that
  even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
  odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}
// r[0..7] as an 8 x 8 matrix of 32-bit lanes, transposed in place (24 shuffles)
inline void vtranspose(V* r) {
  V t[8], u[8];
  for (int i = 0; i < 4; ++i) {  // per 128-bit half k: r[2i][4k], r[2i+1][4k], r[2i][4k+1], r[2i+1][4k+1] | ...
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4i + c], half k: column 4k + c of rows 4i .. 4i + 3
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}
#endif

// float32 -> T -> float32: the rounding torch applies when it stores an intermediate as T
inline V vround_to(V v, const float*) { return v; }
#ifdef PL_AVX512
inline V vround_to(V v, const bf16*) {
  const V r = vcast_f(_mm512_and_si512(bf16_rne(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, v);  // NaN stays NaN
}
inline V vround_to(V v, const f16*) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#else
inline V vround_to(V v, const bf16*) {
  const V r = vcast_f(_mm256_and_si256(bf16_rne(v), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  return _mm256_blendv_ps(r, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));  // NaN stays NaN
}
inline V vround_to(V v, const f16*) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif
template <typename T> inline V vround_as(V v) { return vround_to(v, static_cast<const T*>(nullptr)); }

// ----------------------------------------------------------------------------- integer vectors
// VI: a V's worth of integers (kLanes int32 lanes, 4 * kLanes bytes), for int8 dot products.
#ifdef PL_AVX512
using VI = __m512i;
inline V vcvt_i32(VI a) { return _mm512_cvtepi32_ps(a); }  // int32 lanes -> float32
inline VI vi_load(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VI vi_and(VI a, VI b) { return _mm512_and_si512(a, b); }
inline VI vi_high_nibbles(VI a) { return _mm512_and_si512(_mm512_srli_epi16(a, 4), _mm512_set1_epi8(0x0F)); }
inline VI vi_bcast(int32_t v) { return _mm512_set1_epi32(v); }
inline VI vi_set1_8(char v) { return _mm512_set1_epi8(v); }
inline VI vi_zero() { return _mm512_setzero_si512(); }
inline VI vi_abs8(VI w) { return _mm512_abs_epi8(w); }
inline VI vi_sign8(VI x, VI w) {  // x negated where w < 0 (w == 0: |w| = 0 makes the product 0 anyway)
  return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
}
inline VI vi_dot(VI acc, VI u, VI x) {  // u unsigned 8-bit . x signed 8-bit, 4 products per int32 lane
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, u, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1)));
#endif
}
inline VI vi_dot16(VI acc, VI u, VI x) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, x)); }  // 2 a lane
inline VI vi_widen(VI a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }  // int16 pairs -> int32 lanes
inline VI vi_add(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI vi_or_and(VI a, VI b, VI c) { return _mm512_ternarylogic_epi32(a, b, c, 0xF8); }  // a | (b & c), one op
template <int S> inline VI vi_shift16(VI a) {  // each 16-bit lane shifted left by S bits (right by -S)
  if constexpr (S > 0) return _mm512_slli_epi16(a, S);
  else if constexpr (S < 0) return _mm512_srli_epi16(a, -S);
  else return a;
}
inline V vload(const uint8_t* p) {  // 16 unsigned bytes as float32 lanes
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
using VI = __m256i;
inline V vcvt_i32(VI a) { return _mm256_cvtepi32_ps(a); }  // int32 lanes -> float32
inline VI vi_load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VI vi_and(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI vi_high_nibbles(VI a) { return _mm256_and_si256(_mm256_srli_epi16(a, 4), _mm256_set1_epi8(0x0F)); }
inline VI vi_bcast(int32_t v) { return _mm256_set1_epi32(v); }
inline VI vi_set1_8(char v) { return _mm256_set1_epi8(v); }
inline VI vi_zero() { return _mm256_setzero_si256(); }
inline VI vi_abs8(VI w) { return _mm256_sign_epi8(w, w); }
inline VI vi_sign8(VI x, VI w) { return _mm256_sign_epi8(x, w); }
inline VI vi_dot(VI acc, VI u, VI x) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}
inline VI vi_dot16(VI acc, VI u, VI x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, x)); }
inline VI vi_widen(VI a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
inline VI vi_add(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI vi_or_and(VI a, VI b, VI c) { return _mm256_or_si256(a, _mm256_and_si256(b, c)); }  // a | (b & c)
template <int S> inline VI vi_shift16(VI a) {
  if constexpr (S > 0) return _mm256_slli_epi16(a, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(a, -S);
  else return a;
}
inline V vload(const uint8_t* p) {  // 8 unsigned bytes as float32 lanes
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif
#if defined(PL_AVX512) && defined(__AVX512VNNI__)
constexpr bool kVnni = true;  // vi_dot is vpdpbusd: u8 x s8 products summed straight into int32 lanes, no saturation
#else
constexpr bool kVnni = false;  // vi_dot is vpmaddubsw + vpmaddwd: int16 pair sums, saturating at 2^15
#endif

// x = n ln2 + r, |r| <= ln2 / 2: returns n (integral), r in `r` (ln2 in two parts: r keeps its precision)
inline V vexp_split(V x, V& r) {
  const V n = vround(vmul(x, vset1(1.44269504088896341f)));
  r = vfma(n, vset1(-0.693145751953125f), x);
  r = vfma(n, vset1(-1.428606765330187045e-06f), r);
  return n;
}

// exp(r) for |r| <= ln2 / 2 by its Taylor series to r^kDegree, Horner from the highest term
template <int kDegree>
inline V vexp_taylor(V r) {
  constexpr float kInvFactorial[] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};
  static_assert(kDegree >= 1 && kDegree <= 7, "up to r^7");
  V p = vset1(kInvFactorial[kDegree]);
  for (int k = kDegree - 1; k >= 0; --k) p = vfma(p, r, vset1(kInvFactorial[k]));
  return p;
}

// exp(x) in float32: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor series to r^7 (error
// below 1 ulp), times 2^n built in two halves so that results down to the denormals and up to
// inf come out right (x is clamped to [-104, 89]: exp of anything lower is 0 in float32).
inline V vexp(V x) {
  x = vmin(vmax(x, vset1(-104.f)), vset1(89.f));
  V r;
  const V n = vexp_split(x, r);
  const V p = vexp_taylor<7>(r);
  const V half = vfloor(vmul(n, vset1(0.5f)));  // 2^n = 2^half * 2^(n - half), each factor in range
  return vmul(vmul(p, vpow2i(half)), vpow2i(vsub(n, half)));
}

// exp(x) for x <= 0, as softmax weights need it: exactly 0 below -87 (where exp is under float32's normal
// range), else 2^n exp(r) with exp(r) by its Taylor series to r^6 (relative error ~1.2e-7); -inf gives 0. About
// 2/3 of vexp's instructions.
inline V vexp_neg(V x) {
  const V y = vmax(x, vset1(-87.f));
  V r;
  const V n = vexp_split(y, r);
  return vzero_below(vmul(vexp_taylor<6>(r), vpow2i(n)), x, -87.f);
}

#ifdef PL_AVX512
// 2^y for y <= 0 where the result is rounded to bf16 next (flash attention's weights): y = n + f, |f| <= 1/2, 2^f
// by the Taylor series of e^(f ln 2) to the 4th power (relative error below 5e-5, a fortieth of bf16's step),
// times 2^n by one vscalefps; y below -150 (and -inf) gives exactly 0. Half of vexp_neg's instructions.
inline V vexp2_neg_coarse(V y) {
  y = vmax(y, vset1(-160.f));
  const V n = vround(y);
  const V f = vmul(vsub(y, n), vset1(0.6931471805599453f));
  return _mm512_scalef_ps(vexp_taylor<4>(f), n);
}
#endif

// silu(g) = g / (1 + exp(-g))
inline V vsilu(V g) { return vdiv(g, vadd(vset1(1.f), vexp(vsub(vzero(), g)))); }

// Threads: every parallel region asks for the count torch uses (passed down from Python), so the
// kernels and torch's own ops share one OpenMP pool of the same size.
template <typename Fn>
inline void parallel_for(int64_t n, int threads, int64_t grain, const Fn& fn) {
  if (n <= 0) return;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(threads, (n + grain - 1) / grain));
  if (chunks == 1) {
    fn(0, n);
    return;
  }
#pragma omp parallel for num_threads(static_cast<int>(chunks)) schedule(static, 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = n * c / chunks, end = n * (c + 1) / chunks;
    if (begin < end) fn(begin, end);
  }
}

}  // namespace pl
