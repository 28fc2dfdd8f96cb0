// bf16 GEMM on AMX tiles for the few rows of a decode step, at the "amx" level: out (M, N) = x (M, K) W^T with
// W the plain (N, K) row-major weight as torch holds it (no packed copy: larger steps give the same weight to
// oneDNN through F.linear, layers/prepack.py).
//
// Few rows make the product a stream of the weight: the tiles compute C^T = W x^T, 16 weight rows x 32 k an
// A tile read straight from W (row stride K x 2 bytes), x re-laid once per call as (k pairs, 16 rows, 2) B
// tiles, so the weight is read once, in order, by 16 or 32 row streams. Measured on 2 Xeon cores (AMX), bf16,
// weight from memory, against oneDNN's prepacked matmul: 6144 x 2048 at 1 row 21-23 GB/s (oneDNN 16.7), 16 rows
// 18.7 (16.6), 32 rows 15-18.5 (13.5-14.3); since the prefetches and the transposed stores (the 1.7B shape's four
// matrices, 2 threads, a quiet machine reading 33 GB/s): 1 row 33.3 GB/s, 16 rows 32.7, 32 rows 29.4.
#include <algorithm>
#include <vector>
#include "amx.h"
#include "common.h"

namespace {
constexpr int64_t kAmxGemmRows = 32;  // two B tiles of 16 rows: C tiles for 32 weight rows x 32 x rows
constexpr int64_t kPrefetch = 8;      // k-chunks (64 bytes of a weight row) prefetched ahead of the tiles
}  // namespace

#ifdef PL_AMX
namespace {
using namespace pl;

// One unit of 32 weight rows (16 when `two` is false) at w against the packed x (mb blocks of 16 rows): C^T
// into ct (32 weight rows x 32 x rows, float32). Tiles 0-3 C, 4-5 W, 6-7 x.
__attribute__((target("amx-tile,amx-bf16"))) void unit(const uint16_t* w, int64_t K, const uint16_t* xp, int64_t mb,
                                                       bool two, float* ct) {
  const int64_t kc_count = K / 32;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t rows = two ? 32 : 16;
  for (int64_t kc = 0; kc < kc_count; ++kc) {
    // every weight row's cache line kPrefetch k-chunks ahead (past the row's end: the next unit's rows), so the
    // 16-32 row streams stay in flight while the tiles compute (32 rows of x, 1.7B shape's matrices from memory,
    // 2 threads: 40.6 -> 36.5 ms, 26.4 -> 29.4 GB/s of the machine's 33)
    const int64_t ahead = kc + kPrefetch, past = ahead >= kc_count;
    const uint16_t* pf = w + (past ? rows * K : 0) + (past ? ahead - kc_count : ahead) * 32;
    for (int64_t r = 0; r < rows; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf + r * K), _MM_HINT_T0);
    _tile_loadd(4, w + kc * 32, K * 2);
    _tile_loadd(6, xp + kc * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) {
      _tile_loadd(5, w + 16 * K + kc * 32, K * 2);
      _tile_dpbf16ps(1, 5, 6);
    }
    if (mb > 1) {
      _tile_loadd(7, xp + (kc_count + kc) * 512, 64);
      _tile_dpbf16ps(2, 4, 7);
      if (two) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, ct, 128);
  _tile_stored(1, ct + 16 * 32, 128);
  _tile_stored(2, ct + 16, 128);
  _tile_stored(3, ct + 16 * 32 + 16, 128);
}

// out[m][j] = ct[j][m] in bf16 for the M x rows and jb blocks of 16 weight rows: 16 x 16 blocks transposed in
// registers (a scalar loop over the 1,024 values cost up to a third of a 32-row unit's tile time at K = 2048).
void store_transposed(const float* ct, int64_t M, int jb, pl::bf16* out, int64_t ldc) {
  for (int b = 0; b < jb; ++b)
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      V r[16];
      for (int i = 0; i < 16; ++i) r[i] = vload(ct + (b * 16 + i) * 32 + m0);  // weight row b*16+i, x rows m0..
      vtranspose(r);                                                           // r[k]: x row m0 + k
      for (int64_t k = 0; k < std::min<int64_t>(16, M - m0); ++k) vstore(out + (m0 + k) * ldc + b * 16, r[k]);
    }
}
}  // namespace
#endif

// x (M, K) bf16 at row stride lda, w (N, K) bf16 contiguous, out (M, N) bf16 at row stride ldc: out = x w^T, for
// M <= 32, K a multiple of 32 and N of 16, where the library has AMX and the OS grants the tile state.
PL_EXPORT int pl_amx_gemm(const void* x, int64_t lda, const void* w, void* out, int64_t ldc, int64_t M, int64_t N,
                          int64_t K, int threads) {
#ifdef PL_AMX
  if (M < 1 || M > kAmxGemmRows || K % 32 != 0 || N % 16 != 0) {
    pl::set_error("amx_gemm takes 1-%lld rows, K a multiple of 32 and N of 16 (got %lld, %lld, %lld)",
                  static_cast<long long>(kAmxGemmRows), static_cast<long long>(M), static_cast<long long>(K),
                  static_cast<long long>(N));
    return -1;
  }
  if (!pl::amx_permitted()) {
    pl::set_error("the OS does not grant this process the AMX tile state");
    return -1;
  }
  const int64_t mb = (M + 15) / 16, pairs = K / 2;
  // x as B tiles: (mb, K / 2 pairs, 16 rows) 32-bit words, a word holding one row's dims (2p, 2p + 1); rows past M
  // zero
  std::vector<uint32_t> xp(mb * pairs * 16, 0);
  for (int64_t m = 0; m < M; ++m) {
    const uint32_t* row = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(x) + m * lda);
    uint32_t* dst = xp.data() + (m / 16) * pairs * 16 + m % 16;
    for (int64_t p = 0; p < pairs; ++p) dst[p * 16] = row[p];
  }
  const uint16_t* wp = static_cast<const uint16_t*>(w);
  const uint16_t* xw = reinterpret_cast<const uint16_t*>(xp.data());
  pl::bf16* o = static_cast<pl::bf16*>(out);
  const int64_t units = (N + 31) / 32;
  pl::parallel_for(units, threads, 4, [&](int64_t begin, int64_t end) {
    const pl::AmxTiles tiles(true);
    alignas(64) float ct[32 * 32];
    for (int64_t u = begin; u < end; ++u) {
      const int64_t n = u * 32;
      const bool two = n + 16 < N;
      unit(wp + n * K, K, xw, mb, two, ct);
      store_transposed(ct, M, two ? 2 : 1, o + n, ldc);
    }
  });
  return 0;
#else
  (void)x, (void)lda, (void)w, (void)out, (void)ldc, (void)M, (void)N, (void)K, (void)threads;
  pl::set_error("this kernel library has no AMX tiles (the avx512_bf16 one has)");
  return -1;
#endif
}
