// What the quantized GEMM's two files share (quant.cpp: the formats as the file has them, Q8_0 / Q4_0 / Q4_1
// packed, the C interface; quant_k.cpp: the K-quants packed): GGML's type numbers, the activations quantized
// per 32, the packed layouts' row groups and the loop that hands their tiles out to threads.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include "common.h"

namespace pl::quant {

// GGML's type numbers
enum QType : int { kQ8_0 = 8, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// Whether the packed GEMVs prefetch their weight streams ahead in software: on Intel CPUs, where it was measured to
// pay (1.7B shape's Q4_K_M batch-1 decode +7 to +27% on the 2-core AMX Xeon; Q4_1 GEMVs 9-25% faster), not
// elsewhere: on a Zen 4 EPYC the same prefetches made the cold 1-row GEMVs 1.3-1.9x slower (its hardware prefetchers
// keep more lines in flight alone; benchmarks/quant_kernels.py --cold, docs/BENCHMARKS.md).
inline bool stream_prefetch() {
  static const bool on = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return on;
}

inline float half(const uint8_t* p) {  // an f16 field of a block
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The 6-bit scale and min of chunk j (0..7) of a Q4_K / Q5_K super-block from its 12 bytes `s`: chunks 0-3 in
// the low 6 bits of bytes j and j + 4; chunks 4-7 in the nibbles of byte j + 4, their top 2 bits in the top
// bits of bytes j - 4 and j.
inline void k_scale_min(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63, mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Activations quantized per chunk of 32: int8 values, their scale d, their sum, the sum of the chunk's first 16
// (Q6_K's scales cover 16 values), and d * sum.
struct QRow {
  std::vector<int8_t> q;
  std::vector<int32_t> sum, sum16;
  std::vector<float> d, s;
};

// The packed layouts hold rows in groups of kGroup: one V of outputs, 8 rows with 256-bit registers, 16 with
// AVX-512's. Within a chunk of 32 values, 4 * kGroup bytes ("quad" t) hold values 4t..4t+3 of each of the group's
// rows side by side, so that one broadcast of x's quad t gives the group's kGroup partial sums in one register.
constexpr int kGroup = kLanes;
constexpr int64_t kQuad = 4 * kGroup;  // bytes of one quad of a group

constexpr int64_t kRows = 64;  // activation rows per unit of work (their quantized values stay in L2)

// out tiles of a packed matrix (groups of kGroup features) handed to threads: units of 2 groups x kRows rows;
// tile(std::integral_constant MR, std::integral_constant G, m, g) computes MR rows from m, G groups from g.
template <typename Tile>
void packed_units(int64_t M, int64_t groups, int threads, const Tile& tile) {
  using std::integral_constant;
  const int64_t col_units = (groups + 1) / 2, row_units = (M + kRows - 1) / kRows;
  parallel_for(col_units * row_units, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t m0 = (u / col_units) * kRows, g0 = (u % col_units) * 2;
      const int64_t m1 = std::min(M, m0 + kRows), two = std::min<int64_t>(2, groups - g0);
      const int64_t full = m0 + (m1 - m0) / 4 * 4;
#ifdef PL_AVX512
      // 4 rows x 2 groups: 8 int + 8 float sums of AVX-512's 32 registers; each broadcast of x serves 2 groups
      for (int64_t m = m0; m < full; m += 4) {
        if (two == 2) tile(integral_constant<int, 4>{}, integral_constant<int, 2>{}, m, g0);
        else tile(integral_constant<int, 4>{}, integral_constant<int, 1>{}, m, g0);
      }
#else
      for (int64_t g = g0; g < g0 + two; ++g)  // 4 rows x 1 group: 4 int + 4 float sums, 2 weight registers
        for (int64_t m = m0; m < full; m += 4) tile(integral_constant<int, 4>{}, integral_constant<int, 1>{}, m, g);
#endif
      // the last 1-3 rows (a decode step's one row) in one tile: each weight register serves them all (a
      // speculative step's 1 + drafts rows cost about one pass over the weights); each row's sums are as alone
      const auto tail = [&](auto mr) {
#ifndef PL_AVX512
        if constexpr (decltype(mr)::value > 1) {  // 16 registers: one group at a time
          for (int64_t g = g0; g < g0 + two; ++g) tile(mr, integral_constant<int, 1>{}, full, g);
          return;
        }
#endif
        if (two == 2) tile(mr, integral_constant<int, 2>{}, full, g0);
        else tile(mr, integral_constant<int, 1>{}, full, g0);
      };
      switch (m1 - full) {
        case 1: tail(integral_constant<int, 1>{}); break;
        case 2: tail(integral_constant<int, 2>{}); break;
        case 3: tail(integral_constant<int, 3>{}); break;
        default: break;
      }
    }
  });
}

// The K-quants' packed layout (quant_k.cpp). Q4_K, Q5_K and Q6_K only.
int64_t k_packed_bytes(int qtype, int64_t N, int64_t K);
void k_pack(int qtype, const uint8_t* raw, uint8_t* out, int64_t N, int64_t K, int threads);
template <typename T>
void k_packed_gemm(int qtype, const QRow& q, const uint8_t* w, T* out, int64_t ldc, int64_t M, int64_t N, int64_t K,
                   int threads);
void k_packed_chunk(int qtype, const uint8_t* w, int64_t n, int64_t c, int64_t K, float* y);  // row n, chunk c

}  // namespace pl::quant
