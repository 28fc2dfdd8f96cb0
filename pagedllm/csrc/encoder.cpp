// Bidirectional attention for encoder-only models (BERT-style embedders, cross-encoders, ModernBERT): whole
// sequences one after the other in a flat batch, no KV cache, every token attending to every token of its own
// sequence (or, with a window, to those at most `window` positions away).
//
// q, k and v are read in place from the QKV projection's output ((tokens, heads, head_dim) with any token
// stride), so there is no gathered or padded copy; the output is written (tokens, heads, head_dim), contiguous.
// Two phases, each split between threads by cost:
// 1. every (sequence, head)'s keys are packed once into panels of kStep keys, transposed by in-register
//    transposes (vtranspose) so that a vector holds one dim (or bf16 dim pair) of a run of keys; a panel is
//    read front to back by the product (a row-major K^T thrashed L1 at 384 keys);
// 2. work items of (sequence, head, up to kBlockRows query rows): the scores of kTile query rows and kStep keys
//    grow by FMAs against broadcast q values (no horizontal sums), are masked to each row's band and their
//    running maxima kept in registers; one pass per row then turns them into weights exp(scale * (s - max))
//    (vexp_neg) and sums them; the output of kTile rows and 2 * kLanes dims grows by FMAs of V rows against
//    broadcast weights and is scaled by 1 / sum.
// Sequences longer than the caller's `longest` are skipped (attention/encoder.py gives them to torch's SDPA,
// which is faster there than the vector paths: oneDNN's blocked GEMMs, AMX tiles for bf16).
//
// Paths (head_dim a multiple of 32):
// - bf16 at the "amx" level (the caller's `amx`, the OS granting the tile state), head_dim up to 128: both products
//   on AMX tiles (AmxPath, below; about twice the vdpbf16ps path's speed, and ahead of torch's SDPA up to ~300
//   tokens);
// - bf16 on AVX512-BF16: both products by vdpbf16ps on bf16 pairs (keys packed as (D / 2, keys, 2), V rows as
//   (keys / 2, D, 2), the weights rounded to bf16 as torch's SDPA rounds them before its second product);
// - every level and storage type: float32 FMAs (keys packed as float32 (D, keys); V read in place).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include "amx.h"
#include "common.h"

namespace {
using namespace pl;

constexpr int64_t kBlockRows = 64;  // query rows per work item: a long sequence's rows go to several threads
#ifdef PL_AVX512
constexpr int kTile = 8;  // query rows per register tile: 8 x 2 accumulators of the 32 zmm registers
#else
constexpr int kTile = 4;  // 4 x 2 of the 16 ymm registers
#endif
constexpr int64_t kStep = 2 * kLanes;  // keys (in q.k) or head dims (in p.v) per tile row

struct Args {
  const void *q, *k, *v;
  int64_t qs, ks, vs;  // token strides, in elements
  void* out;
  const int32_t* starts;  // (sequences + 1,) each sequence's first token; the last entry is the token count
  int64_t nh, D;
  float scale;
  int64_t window;          // < 0: none
  int64_t longest;         // > 0: longer sequences are skipped
  uint32_t* packed;        // each (sequence, head)'s keys as packed by the path (D x W 32-bit words), one after another
  const int64_t* offsets;  // (sequences,) where each sequence's heads start in `packed`
};

inline int64_t seq_len(const Args& a, int64_t seq) { return a.starts[seq + 1] - a.starts[seq]; }
inline int64_t width(int64_t n) { return (n + kStep - 1) / kStep * kStep; }  // keys padded to whole tiles

struct Item {
  int64_t seq, head, r0, r1;  // query rows [r0, r1) of the sequence
};

// The keys an item reads: [k0, k0 + n) of its sequence (k0 a multiple of kStep), W = width(n) of them.
struct Keys {
  int64_t k0, n, W;
};

inline Keys keys_of(const Args& a, const Item& it) {
  const int64_t L = seq_len(a, it.seq);
  int64_t k0 = 0, k1 = L;
  if (a.window >= 0) {
    k0 = std::max<int64_t>(0, it.r0 - a.window) / kStep * kStep;
    k1 = std::min<int64_t>(L, it.r1 + a.window);  // the last row is r1 - 1: keys up to r1 - 1 + window
  }
  return {k0, k1 - k0, width(k1 - k0)};
}

// The keys row `row` attends to: [lo, hi), relative to ks.k0.
inline void band(const Args& a, const Keys& ks, int64_t row, int64_t& lo, int64_t& hi) {
  if (a.window < 0) {
    lo = 0, hi = ks.n;
    return;
  }
  lo = std::max<int64_t>(0, row - a.window - ks.k0);
  hi = std::min<int64_t>(ks.n, row + a.window + 1 - ks.k0);
}

// The bands of the rows [r0, r0 + rows) (rows <= kTile), and the keys they attend to together: [jlo, jhi),
// widened to whole vectors (at most W).
struct TileBands {
  int64_t lo[kTile], hi[kTile], jlo, jhi;
};

inline TileBands tile_bands(const Args& a, const Keys& ks, int64_t r0, int rows) {
  TileBands b;
  for (int r = 0; r < rows; ++r) band(a, ks, r0 + r, b.lo[r], b.hi[r]);
  b.jlo = b.lo[0] / kLanes * kLanes;
  b.jhi = std::min(ks.W, (b.hi[rows - 1] + kLanes - 1) / kLanes * kLanes);
  return b;
}

// A row's scores for keys [j, j + kLanes), -inf where outside its band [lo, hi): stored, and its running max.
inline void score_out(V x, int64_t j, int64_t lo, int64_t hi, float* s, V& top) {
  if (j < lo || j + kLanes > hi) x = vkeep_range(x, lo - j, hi - j, -INFINITY);
  vstore(s + j, x);
  top = vmax(top, x);
}

// exp(scale * (s - top)) of a row's scores over [jlo, jhi) (a multiple of kLanes; -inf gives 0), stored back, in
// float32 (or passed to `store`); returns 1 / their sum.
template <typename Store>
inline float exp_row(float* s, int64_t jlo, int64_t jhi, float top, float scale, const Store& store) {
  const V vs = vset1(scale), shift = vset1(-top * scale);
  V total = vzero();
  for (int64_t t = jlo; t < jhi; t += kLanes) {
    const V e = vexp_neg(vfma(vload(s + t), vs, shift));
    store(t, e);
    total = vadd(total, e);
  }
  return 1.f / vsum(total);
}

// fn(std::integral_constant<int, rows>), rows in 1 .. kTile: tiles of a compile-time height
template <typename Fn>
inline void with_rows(int rows, const Fn& fn) {
  switch (rows) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
#ifdef PL_AVX512
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 5: fn(std::integral_constant<int, 5>{}); break;
    case 6: fn(std::integral_constant<int, 6>{}); break;
    case 7: fn(std::integral_constant<int, 7>{}); break;
#endif
    default: fn(std::integral_constant<int, kTile>{}); break;
  }
}

// rows x kLanes 32-bit words at src (row stride ss) -> dst (kLanes rows of `rows` words, row stride ds), rows
// <= kLanes; the missing rows of a partial block as zeros. `load(i)` gives row i as a vector.
template <typename Load>
inline void transpose_block(const Load& load, int64_t rows, float* dst, int64_t ds) {
  V r[kLanes];
  for (int i = 0; i < kLanes; ++i) r[i] = i < rows ? load(i) : vzero();
  vtranspose(r);
  for (int i = 0; i < kLanes; ++i) vstore(dst + i * ds, r[i]);
}

// ------------------------------------------------------------------ float32 FMA path (every level and type)

// s (R x W) = q rows (R x D, float32) . kt (W / kStep panels of (D, kStep) keys), -inf outside each row's band;
// the rows' maxima in top
template <int R>
inline void scores_fma(const float* qf, const float* kt, int64_t D, int64_t W, const TileBands& b, float* s,
                       float* top) {
  V mx[R];
  for (int r = 0; r < R; ++r) mx[r] = vset1(-INFINITY);
  for (int64_t j = 0; j < W; j += kStep) {
    V acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
    for (int64_t d = 0; d < D; ++d) {
      const V k0 = vload(kt + (j * D + d * kStep)), k1 = vload(kt + (j * D + d * kStep) + kLanes);
      for (int r = 0; r < R; ++r) {
        const V qb = vset1(qf[r * D + d]);
        acc[r][0] = vfma(qb, k0, acc[r][0]);
        acc[r][1] = vfma(qb, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      score_out(acc[r][0], j, b.lo[r], b.hi[r], s + r * W, mx[r]);
      score_out(acc[r][1], j + kLanes, b.lo[r], b.hi[r], s + r * W, mx[r]);
    }
  }
  for (int r = 0; r < R; ++r) top[r] = vmaxval(mx[r]);
}

// out rows (R, each at out + r * os) = (p rows over keys [jlo, jhi)) . v * inv[r]
template <int R, typename T>
inline void output_fma(const float* p, int64_t W, const T* v, int64_t vs, int64_t D, int64_t jlo, int64_t jhi,
                       const float* inv, T* out, int64_t os) {
  for (int64_t d = 0; d < D; d += kStep) {
    V acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vzero();
    for (int64_t j = jlo; j < jhi; ++j) {
      const V v0 = vload(v + j * vs + d), v1 = vload(v + j * vs + d + kLanes);
      for (int r = 0; r < R; ++r) {
        const V pb = vset1(p[r * W + j]);
        acc[r][0] = vfma(pb, v0, acc[r][0]);
        acc[r][1] = vfma(pb, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const V f = vset1(inv[r]);
      vstore(out + r * os + d, vmul(acc[r][0], f));
      vstore(out + r * os + d + kLanes, vmul(acc[r][1], f));
    }
  }
}

template <typename T>
struct FmaPath {
  std::vector<float> qf, s;

  // A (sequence, head)'s keys as float32 (D, W): a vector holds one dim of kLanes keys; padded keys are 0.
  static void pack(const Args& a, int64_t seq, int64_t head, uint32_t* dst) {
    const int64_t L = seq_len(a, seq), W = width(L), D = a.D;
    const T* k = static_cast<const T*>(a.k) + a.starts[seq] * a.ks + head * D;
    float* kt = reinterpret_cast<float*>(dst);
    for (int64_t j = 0; j < W; j += kLanes)
      for (int64_t d = 0; d < D; d += kLanes)
        transpose_block([&](int i) { return vload(k + (j + i) * a.ks + d); }, std::min<int64_t>(kLanes, L - j),
                        kt + j / kStep * kStep * D + d * kStep + j % kStep, kStep);
  }

  void run(const Args& a, const Item& it) {
    const Keys ks = keys_of(a, it);
    const int64_t D = a.D, base = a.starts[it.seq], SW = width(seq_len(a, it.seq)), W = ks.W, hd = it.head * D;
    const float* kt = reinterpret_cast<const float*>(a.packed + a.offsets[it.seq] + it.head * D * SW) + ks.k0 * D;
    const T* v = static_cast<const T*>(a.v) + (base + ks.k0) * a.vs + hd;
    qf.resize(kTile * D);
    s.resize(kTile * W);
    for (int64_t r0 = it.r0; r0 < it.r1; r0 += kTile) {
      const int rows = static_cast<int>(std::min<int64_t>(kTile, it.r1 - r0));
      const T* q = static_cast<const T*>(a.q) + (base + r0) * a.qs + hd;
      for (int r = 0; r < rows; ++r)
        for (int64_t d = 0; d < D; d += kLanes) vstore(qf.data() + r * D + d, vload(q + r * a.qs + d));
      const TileBands b = tile_bands(a, ks, r0, rows);
      float top[kTile], inv[kTile];
      with_rows(rows, [&](auto R) { scores_fma<R.value>(qf.data(), kt, D, W, b, s.data(), top); });
      for (int r = 0; r < rows; ++r) {
        float* sr = s.data() + r * W;
        inv[r] = exp_row(sr, b.jlo, b.jhi, top[r], a.scale, [&](int64_t t, V e) { vstore(sr + t, e); });
      }
      // the padded keys in [jlo, jhi) have weight 0 but no V row: stop at the last key
      const int64_t jhi = std::min(b.jhi, ks.n);
      T* out = static_cast<T*>(a.out) + (base + r0) * a.nh * D + hd;
      with_rows(rows, [&](auto R) { output_fma<R.value>(s.data(), W, v, a.vs, D, b.jlo, jhi, inv, out, a.nh * D); });
    }
  }
};

// ------------------------------------------------------------------ vdpbf16ps path (bf16, AVX512-BF16)
#ifdef __AVX512BF16__
// s (R x W) = q rows (R x D bf16 as D / 2 pairs, row stride qs words) . kp (W / kStep panels of (D / 2, kStep)
// key pairs), -inf outside each row's band; the rows' maxima in top
template <int R>
inline void scores_dp(const uint32_t* qp, int64_t qs, const uint32_t* kp, int64_t D, int64_t W, const TileBands& b,
                      float* s, float* top) {
  const int64_t P = D / 2;
  V mx[R];
  for (int r = 0; r < R; ++r) mx[r] = vset1(-INFINITY);
  for (int64_t j = 0; j < W; j += kStep) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + (j * P + p * kStep));
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + (j * P + p * kStep) + 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * qs + p]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
      }
    }
    for (int r = 0; r < R; ++r) {
      score_out(acc[r][0], j, b.lo[r], b.hi[r], s + r * W, mx[r]);
      score_out(acc[r][1], j + 16, b.lo[r], b.hi[r], s + r * W, mx[r]);
    }
  }
  for (int r = 0; r < R; ++r) top[r] = vmaxval(mx[r]);
}

// out rows = (pp rows: the weights as bf16 pairs over key pairs [plo, phi)) . vp (key pairs, D, 2) * inv[r]
template <int R>
inline void output_dp(const uint32_t* pp, int64_t PW, const uint32_t* vp, int64_t D, int64_t plo, int64_t phi,
                      const float* inv, bf16* out, int64_t os) {
  for (int64_t d = 0; d < D; d += 32) {
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t jp = plo; jp < phi; ++jp) {
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vp + jp * D + d);
      const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vp + jp * D + d + 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * PW + jp]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pb, v0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pb, v1);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 f = _mm512_set1_ps(inv[r]);
      vstore(out + r * os + d, _mm512_mul_ps(acc[r][0], f));
      vstore(out + r * os + d + 16, _mm512_mul_ps(acc[r][1], f));
    }
  }
}

struct DpPath {
  std::vector<uint32_t> pp;
  std::vector<float> s;

  // A (sequence, head)'s keys as bf16 pairs (D / 2, W, 2), then its V rows two by two interleaved (W / 2, D, 2)
  // (a vector holds dims 2p, 2p + 1 of 16 keys, or dims d .. d + 15 of two rows); padded keys and rows are 0.
  static void pack(const Args& a, int64_t seq, int64_t head, uint32_t* dst) {
    const int64_t L = seq_len(a, seq), W = width(L), D = a.D, P = D / 2;
    const bf16* k = static_cast<const bf16*>(a.k) + a.starts[seq] * a.ks + head * D;
    const bf16* v = static_cast<const bf16*>(a.v) + a.starts[seq] * a.vs + head * D;
    float* kp = reinterpret_cast<float*>(dst);  // moved as float lanes: the shuffles keep every bit
    for (int64_t j = 0; j < W; j += 16)
      for (int64_t p = 0; p < P; p += 16)
        transpose_block([&](int i) { return _mm512_castsi512_ps(_mm512_loadu_si512(k + (j + i) * a.ks + 2 * p)); },
                        std::min<int64_t>(16, L - j), kp + j / kStep * kStep * P + p * kStep + j % kStep, kStep);
    uint32_t* vp = dst + P * W;
    const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                            37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
    for (int64_t jp = 0; jp < W / 2; ++jp) {
      const bf16* r0 = v + 2 * jp * a.vs;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i x = 2 * jp < L ? _mm512_loadu_si512(r0 + d) : _mm512_setzero_si512();
        const __m512i y = 2 * jp + 1 < L ? _mm512_loadu_si512(r0 + a.vs + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(vp + jp * D + d, _mm512_permutex2var_epi16(x, lo_idx, y));
        _mm512_storeu_si512(vp + jp * D + d + 16, _mm512_permutex2var_epi16(x, hi_idx, y));
      }
    }
  }

  void run(const Args& a, const Item& it) {
    const Keys ks = keys_of(a, it);
    const int64_t D = a.D, P = D / 2, base = a.starts[it.seq], SW = width(seq_len(a, it.seq)), W = ks.W, PW = W / 2,
                  hd = it.head * D;
    const uint32_t* kp = a.packed + a.offsets[it.seq] + it.head * D * SW;
    const uint32_t* vp = kp + P * SW + ks.k0 / 2 * D;  // from the item's first key pair
    kp += ks.k0 * P;
    pp.resize(kTile * PW);
    s.resize(kTile * W);
    for (int64_t r0 = it.r0; r0 < it.r1; r0 += kTile) {
      const int rows = static_cast<int>(std::min<int64_t>(kTile, it.r1 - r0));
      // q rows read in place as bf16 pairs (head_dim and the token stride are even)
      const uint32_t* q = reinterpret_cast<const uint32_t*>(static_cast<const bf16*>(a.q) + (base + r0) * a.qs + hd);
      const TileBands b = tile_bands(a, ks, r0, rows);  // jlo, jhi: multiples of 16, so whole key pairs
      float top[kTile], inv[kTile];
      with_rows(rows, [&](auto R) { scores_dp<R.value>(q, a.qs / 2, kp, D, W, b, s.data(), top); });
      for (int r = 0; r < rows; ++r) {
        bf16* pr = reinterpret_cast<bf16*>(pp.data() + r * PW);  // the weights rounded to bf16, as pairs
        inv[r] = exp_row(s.data() + r * W, b.jlo, b.jhi, top[r], a.scale, [&](int64_t t, V e) { vstore(pr + t, e); });
      }
      bf16* out = static_cast<bf16*>(a.out) + (base + r0) * a.nh * D + hd;
      with_rows(rows,
                [&](auto R) { output_dp<R.value>(pp.data(), PW, vp, D, b.jlo / 2, b.jhi / 2, inv, out, a.nh * D); });
    }
  }
};

// ------------------------------------------------------------------ AMX path (bf16, AMX-BF16 CPUs: the "amx" level)
// Built into the avx512_bf16 library (functions with the AMX target), run only where the caller asks (the "amx"
// level) and the OS grants this process the tile state. Blocks of 16 query rows: the scores of 16 rows x 16 keys
// are one tile product per 32 dims (q rows straight from the projection, the packed key pairs of DpPath as B
// tiles); masked and turned into bf16 weights as in DpPath; the output of 16 rows x 16 dims grows by one tile
// product per 32 keys (weights as A tiles, DpPath's V pairs as B tiles).
#ifdef PL_AMX

constexpr int64_t kAmxMaxDim = 128;  // q tiles for up to 4 x 32 dims stay loaded beside 2 score and 2 key tiles

struct AmxPath : DpPath {
  alignas(64) uint16_t qbuf[16 * kAmxMaxDim];  // a partial block's q rows, zero-padded to 16
  alignas(64) float obuf[16 * 64];             // 16 rows x up to 64 dims of output, from the C tiles

  AmxTiles tiles{true};  // this thread's tiles, configured while the path lives

  static void pack(const Args& a, int64_t seq, int64_t head, uint32_t* dst) { DpPath::pack(a, seq, head, dst); }

  // s (16 x W) = the q block (16 x D bf16 at q, row stride qs bytes) . the key panels (tiles 0, 1: scores of 16
  // keys each; 2-5: q by 32 dims; 6, 7: key pairs)
  template <int kChunks>
  __attribute__((target("amx-tile,amx-bf16"))) static void scores(const void* q, int64_t qs, const uint32_t* kp,
                                                                  int64_t D, int64_t W, float* s) {
    const int64_t P = D / 2;
    _tile_loadd(2, q, qs);
    if (kChunks > 1) _tile_loadd(3, static_cast<const char*>(q) + 64, qs);
    if (kChunks > 2) _tile_loadd(4, static_cast<const char*>(q) + 128, qs);
    if (kChunks > 3) _tile_loadd(5, static_cast<const char*>(q) + 192, qs);
    for (int64_t j = 0; j < W; j += kStep) {
      const uint32_t* panel = kp + j * P;  // (P, 32 keys) words: rows of 128 bytes
      _tile_zero(0);
      _tile_zero(1);
#define PL_QK_CHUNK(c, qt)                                  \
  _tile_loadd(6, panel + (c) * 16 * kStep, kStep * 4);      \
  _tile_loadd(7, panel + (c) * 16 * kStep + 16, kStep * 4); \
  _tile_dpbf16ps(0, qt, 6);                                 \
  _tile_dpbf16ps(1, qt, 7);
      PL_QK_CHUNK(0, 2)
      if (kChunks > 1) {
        PL_QK_CHUNK(1, 3)
      }
      if (kChunks > 2) {
        PL_QK_CHUNK(2, 4)
      }
      if (kChunks > 3) {
        PL_QK_CHUNK(3, 5)
      }
#undef PL_QK_CHUNK
      _tile_stored(0, s + j, W * 4);
      _tile_stored(1, s + j + 16, W * 4);
    }
  }

  // the output of 16 rows and dims [d0, d0 + 16 * kTiles) over key pairs [plo, phi) (a multiple of 16 each):
  // pp (16 rows of PW pairs) . vp (pairs, D, 2), into obuf (16 x 64 floats); tiles 0-3 C, 4 weights, 5 V pairs
  template <int kTiles>
  __attribute__((target("amx-tile,amx-bf16"))) void output(const uint32_t* pp, int64_t PW, const uint32_t* vp,
                                                           int64_t D, int64_t d0, int64_t plo, int64_t phi) {
    _tile_zero(0);
    if (kTiles > 1) _tile_zero(1);
    if (kTiles > 2) _tile_zero(2);
    if (kTiles > 3) _tile_zero(3);
    for (int64_t jp = plo; jp < phi; jp += 16) {
      _tile_loadd(4, pp + jp, PW * 4);       // 16 rows x 32 keys of weights
      const uint32_t* v = vp + jp * D + d0;  // 16 key pairs x 16 dims, rows D words apart
      _tile_loadd(5, v, D * 4);
      _tile_dpbf16ps(0, 4, 5);
      if (kTiles > 1) {
        _tile_loadd(5, v + 16, D * 4);
        _tile_dpbf16ps(1, 4, 5);
      }
      if (kTiles > 2) {
        _tile_loadd(5, v + 32, D * 4);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (kTiles > 3) {
        _tile_loadd(5, v + 48, D * 4);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, obuf, 64 * 4);
    if (kTiles > 1) _tile_stored(1, obuf + 16, 64 * 4);
    if (kTiles > 2) _tile_stored(2, obuf + 32, 64 * 4);
    if (kTiles > 3) _tile_stored(3, obuf + 48, 64 * 4);
  }

  __attribute__((target("amx-tile,amx-bf16"))) void run(const Args& a, const Item& it) {
    const Keys ks = keys_of(a, it);
    const int64_t D = a.D, P = D / 2, base = a.starts[it.seq], SW = width(seq_len(a, it.seq)), W = ks.W, PW = W / 2,
                  hd = it.head * D;
    const uint32_t* kp = a.packed + a.offsets[it.seq] + it.head * D * SW;
    const uint32_t* vp = kp + P * SW + ks.k0 / 2 * D;
    kp += ks.k0 * P;
    pp.resize(16 * PW);
    s.resize(16 * W);
    for (int64_t r0 = it.r0; r0 < it.r1; r0 += 16) {
      const int rows = static_cast<int>(std::min<int64_t>(16, it.r1 - r0));
      const bf16* q = static_cast<const bf16*>(a.q) + (base + r0) * a.qs + hd;
      const void* qt = q;
      int64_t qstride = a.qs * 2;
      if (rows < 16) {  // the tile reads 16 rows: a partial block's come from a zero-padded copy
        std::fill(qbuf, qbuf + 16 * D, uint16_t{0});
        for (int r = 0; r < rows; ++r) std::memcpy(qbuf + r * D, q + r * a.qs, D * 2);
        qt = qbuf, qstride = D * 2;
      }
      switch (D / 32) {
        case 1: scores<1>(qt, qstride, kp, D, W, s.data()); break;
        case 2: scores<2>(qt, qstride, kp, D, W, s.data()); break;
        case 3: scores<3>(qt, qstride, kp, D, W, s.data()); break;
        default: scores<4>(qt, qstride, kp, D, W, s.data()); break;
      }
      int64_t lo[16], hi[16];
      for (int r = 0; r < rows; ++r) band(a, ks, r0 + r, lo[r], hi[r]);
      const int64_t jlo = lo[0] / kStep * kStep, jhi = std::min(W, (hi[rows - 1] + kStep - 1) / kStep * kStep);
      float inv[16];
      for (int r = 0; r < rows; ++r) {
        float* sr = s.data() + r * W;
        V top = vset1(-INFINITY);
        for (int64_t j = jlo; j < jhi; j += kLanes) {
          V x = vload(sr + j);
          if (j < lo[r] || j + kLanes > hi[r]) {
            x = vkeep_range(x, lo[r] - j, hi[r] - j, -INFINITY);
            vstore(sr + j, x);
          }
          top = vmax(top, x);
        }
        bf16* pr = reinterpret_cast<bf16*>(pp.data() + r * PW);
        inv[r] = exp_row(sr, jlo, jhi, vmaxval(top), a.scale, [&](int64_t t, V e) { vstore(pr + t, e); });
      }
      for (int r = rows; r < 16; ++r)  // the block's missing rows: zero weights (their output is dropped)
        std::fill(pp.data() + r * PW + jlo / 2, pp.data() + r * PW + jhi / 2, 0u);
      bf16* out = static_cast<bf16*>(a.out) + (base + r0) * a.nh * D + hd;
      for (int64_t d0 = 0; d0 < D; d0 += 64) {
        const int64_t dims = std::min<int64_t>(64, D - d0);
        switch (dims / 16) {
          case 2: output<2>(pp.data(), PW, vp, D, d0, jlo / 2, jhi / 2); break;
          case 3: output<3>(pp.data(), PW, vp, D, d0, jlo / 2, jhi / 2); break;
          default: output<4>(pp.data(), PW, vp, D, d0, jlo / 2, jhi / 2); break;
        }
        for (int r = 0; r < rows; ++r)
          for (int64_t d = 0; d < dims; d += 16)
            vstore(out + r * a.nh * D + d0 + d, vmul(vload(obuf + r * 64 + d), vset1(inv[r])));
      }
    }
  }
};
#endif  // PL_AMX
#endif  // __AVX512BF16__

// Packs every (sequence, head)'s keys, then runs the items; each phase split between threads by cost.
template <typename Path>
void run_items(const Args& a, int64_t seqs, const std::vector<Item>& items, int threads) {
  parallel_for(seqs * a.nh, threads, 8, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t seq = i / a.nh, head = i % a.nh;
      if (a.longest > 0 && seq_len(a, seq) > a.longest) continue;
      Path::pack(a, seq, head, a.packed + a.offsets[seq] + head * a.D * width(seq_len(a, seq)));
    }
  });
  std::vector<int64_t> cum(items.size() + 1, 0);  // an item's cost: rows x keys, plus a fixed overhead
  for (size_t i = 0; i < items.size(); ++i)
    cum[i + 1] = cum[i] + (items[i].r1 - items[i].r0) * keys_of(a, items[i]).W + 256;
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  auto run = [&](int64_t t) {
    const int64_t begin = std::lower_bound(cum.begin(), cum.end(), cum[n] * t / parts) - cum.begin();
    const int64_t end = std::lower_bound(cum.begin(), cum.end(), cum[n] * (t + 1) / parts) - cum.begin();
    Path path;
    for (int64_t i = std::min(begin, n); i < std::min(end, n); ++i) path.run(a, items[i]);
  };
  if (parts == 1) {
    run(0);
    return;
  }
#pragma omp parallel for num_threads(static_cast<int>(parts)) schedule(static, 1)
  for (int64_t t = 0; t < parts; ++t) run(t);
}

}  // namespace

// q, k, v: (tokens, heads, head_dim) at token strides qs, ks, vs (head stride head_dim, dim stride 1); out
// (tokens, heads, head_dim) contiguous; starts: (seqs + 1,) int32, the first token of each sequence and then
// the token count; window < 0 for none. Sequences longer than `longest` (when > 0) are skipped: their output rows
// are left as they are. With `amx`, bf16 runs on AMX tiles where the library and the OS allow (else on vdpbf16ps).
// head_dim must be a multiple of 32.
PL_EXPORT int pl_encoder_attention(const void* q, int64_t qs, const void* k, int64_t ks, const void* v, int64_t vs,
                                   void* out, const int32_t* starts, int64_t seqs, int64_t nh, int64_t D, float scale,
                                   int64_t window, int64_t longest, int amx, int dtype, int threads) {
  if (D <= 0 || D % 32) {
    set_error("encoder attention needs a head_dim that is a multiple of 32, got %lld", static_cast<long long>(D));
    return -2;
  }
  if (starts[0] != 0) {
    set_error("the first sequence must start at token 0");
    return -2;
  }
  std::vector<Item> items;
  std::vector<int64_t> offsets(seqs);
  int64_t words = 0;
  for (int64_t sq = 0; sq < seqs; ++sq) {
    const int64_t L = starts[sq + 1] - starts[sq];
    if (L <= 0) {
      set_error("sequence %lld has %lld tokens", static_cast<long long>(sq), static_cast<long long>(L));
      return -2;
    }
    offsets[sq] = words;
    if (longest > 0 && L > longest) continue;  // left to the caller
    words += nh * D * width(L);
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t r0 = 0; r0 < L; r0 += kBlockRows) items.push_back({sq, h, r0, std::min(L, r0 + kBlockRows)});
  }
  // the caller's thread keeps its buffer from call to call: no fresh pages to fault in per layer
  static thread_local std::vector<uint32_t> packed;
  if (static_cast<int64_t>(packed.size()) < words) packed.resize(words);
  const Args a{q, k, v, qs, ks, vs, out, starts, nh, D, scale, window, longest, packed.data(), offsets.data()};
#ifdef PL_AMX
  if (amx && dtype == kBF16 && qs % 2 == 0 && D <= kAmxMaxDim && amx_permitted()) {
    run_items<AmxPath>(a, seqs, items, threads);
    return 0;
  }
#endif
#ifdef __AVX512BF16__
  if (dtype == kBF16 && qs % 2 == 0) {  // q rows read as bf16 pairs
    run_items<DpPath>(a, seqs, items, threads);
    return 0;
  }
#endif
  return with_dtype(dtype, [&](auto t) {
    run_items<FmaPath<decltype(t)>>(a, seqs, items, threads);
    return 0;
  });
}
