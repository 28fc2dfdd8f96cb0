// Q4_K, Q5_K and Q6_K packed at load, for the GEMV / GEMM of quant.cpp (llama.cpp's Q4_K_M mix).
//
// Read as the file has them, a row at a time, each 32-value chunk costs a scalar decode of its 6-bit scale and
// min and a horizontal sum: ~7 GB/s of weights at batch 1 on one Zen 4 core, where packed Q4_1 reads 60+. Packed,
// rows go in groups of kGroup (quant.h) with their values laid out as Q4_1's packed chunks (one register holds a
// quad of every row of the group: one broadcast of x and one vpdpbusd give kGroup partial sums), and the
// super-block's scales as one byte per row, converted to float32 kGroup at a time and multiplied by the
// super-block's d (exact in float32: an f16 times a 6- or 8-bit integer, as gguf's decoder computes it; the
// results differ from the row kernel's only by float32 summation order).
//
// Per group and super-block of 256 values: a head of 20 kGroup bytes, then 8 chunks of 32 values:
//   Q4_K, Q5_K head: d[kGroup], dmin[kGroup] (f16), scale[8][kGroup], min[8][kGroup] (6-bit, a byte each);
//     value = d scale q - dmin min
//   Q6_K head: scale[16][kGroup] (int8, one per 16 values), d[kGroup] (f16), 2 kGroup bytes of padding (keeps the
//     chunks on 64-byte lines); value = d scale (q - 32)
//   chunk: 16 kGroup bytes of low nibbles (register s: quad 2s in the low nibbles, quad 2s + 1 in the high ones;
//     byte 4j + b of a quad: row j's value 4t + b), then the high bits at the same byte positions:
//     Q5_K: one register, bit t = the fifth bit of quad t;
//     Q6_K: two registers, register h bits 2p, 2p + 1 = bits 4-5 of quad 4h + p.
// Bytes per 256 values and row: Q4_K 148 (the file's 144), Q5_K 180 (176), Q6_K 212 (210).
#include <algorithm>
#include <utility>
#include "quant.h"

namespace pl::quant {
namespace {

template <int QT> struct KLayout {
  static_assert(QT == kQ4_K || QT == kQ5_K || QT == kQ6_K, "a K-quant");
  static constexpr int64_t kRawBytes = QT == kQ4_K ? 144 : QT == kQ5_K ? 176 : 210;  // a super-block in the file
  static constexpr int64_t kHigh = QT == kQ4_K ? 0 : QT == kQ5_K ? kQuad : 2 * kQuad;
  static constexpr int64_t kHead = 20 * kGroup;
  static constexpr int64_t kChunk = 16 * kGroup + kHigh;
  static constexpr int64_t kSuper = kHead + 8 * kChunk;
  // Below VNNI, quads whose int16 pair sums (|pair| <= 2 * max q * 127) add up under 2^15 before widening
  static constexpr int kRunPairs = QT == kQ4_K ? 4 : QT == kQ5_K ? 2 : 1;  // in pairs of quads: 8, 4, 2 quads
  static constexpr int kSpans = QT == kQ6_K ? 2 : 1;                       // scales per chunk
  static constexpr int kZeroPoint = QT == kQ6_K ? 32 : 0;
};

// Super-block s of a row as the file has it -> its 256 values q (unsigned: 0..15, 0..31, 0..63), and the
// head's fields of row j of the packed group at `head`.
template <int QT>
void unpack_super(const uint8_t* b, uint8_t* q, uint8_t* head, int j) {
  if constexpr (QT == kQ6_K) {
    for (int h = 0; h < 2; ++h)  // two halves of 128: chunk p takes ql[l + 32 (p & 1)]'s nibble p / 2, qh[l]'s bits 2p
      for (int p = 0; p < 4; ++p)
        for (int l = 0; l < 32; ++l) {
          const uint8_t low = b[64 * h + l + 32 * (p & 1)] >> (4 * (p / 2)) & 0x0F;
          q[128 * h + 32 * p + l] = static_cast<uint8_t>(low | ((b[128 + 32 * h + l] >> (2 * p) & 3) << 4));
        }
    for (int i = 0; i < 16; ++i) head[i * kGroup + j] = b[192 + i];
    std::memcpy(head + 16 * kGroup + 2 * j, b + 208, 2);
  } else {
    const uint8_t* nib = b + (QT == kQ4_K ? 16 : 48);
    for (int c = 0; c < 8; ++c)  // chunk c: byte 32 (c / 2) + l's low (c even) or high nibble; Q5_K: bit c of qh[l]
      for (int l = 0; l < 32; ++l) {
        const uint8_t low = nib[32 * (c / 2) + l] >> (4 * (c % 2)) & 0x0F;
        q[32 * c + l] = QT == kQ5_K ? static_cast<uint8_t>(low | ((b[16 + l] >> c & 1) << 4)) : low;
      }
    std::memcpy(head + 2 * j, b, 2);
    std::memcpy(head + 2 * kGroup + 2 * j, b + 2, 2);
    for (int c = 0; c < 8; ++c) {
      int sc, mn;
      k_scale_min(b + 4, c, sc, mn);
      head[4 * kGroup + c * kGroup + j] = static_cast<uint8_t>(sc);
      head[12 * kGroup + c * kGroup + j] = static_cast<uint8_t>(mn);
    }
  }
}

template <int QT>
void pack(const uint8_t* raw, uint8_t* out, int64_t N, int64_t K, int threads) {
  using L = KLayout<QT>;
  const int64_t supers = K / 256, groups = (N + kGroup - 1) / kGroup;
  parallel_for(groups * supers, threads, 16, [&](int64_t begin, int64_t end) {
    uint8_t q[256];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = i / supers, s = i % supers;
      uint8_t* dst = out + i * L::kSuper;  // group g's super-blocks in order
      std::memset(dst, 0, L::kSuper);      // rows past N: d = 0, values 0
      for (int j = 0; j < kGroup && g * kGroup + j < N; ++j) {
        unpack_super<QT>(raw + (g * kGroup + j) * supers * L::kRawBytes + s * L::kRawBytes, q, dst, j);
        for (int k = 0; k < 256; ++k) {
          const int t = k % 32 / 4, b = k % 4;
          uint8_t* chunk = dst + L::kHead + k / 32 * L::kChunk;
          const int64_t pos = 4 * j + b;
          chunk[t / 2 * kQuad + pos] |= static_cast<uint8_t>((q[k] & 0x0F) << (4 * (t % 2)));
          if (QT == kQ5_K) chunk[16 * kGroup + pos] |= static_cast<uint8_t>((q[k] >> 4) << t);
          if (QT == kQ6_K)
            chunk[16 * kGroup + t / 4 * kQuad + pos] |= static_cast<uint8_t>((q[k] >> 4) << (2 * (t % 4)));
        }
      }
    }
  });
}

// Quads 2S and 2S + 1 of a packed chunk `v` (high-bit registers already loaded in h): unsigned values per byte.
template <int QT, int S>
inline void quad_pair(const uint8_t* v, const VI* h, VI& lo, VI& hi) {
  const VI b = vi_load(v + kQuad * S);
  lo = vi_and(b, vi_set1_8(0x0F)), hi = vi_high_nibbles(b);
  if constexpr (QT == kQ5_K) {  // bit t of h to bit 4: shifted by 4 - t (16-bit lanes; other bits masked off)
    lo = vi_or_and(lo, vi_shift16<4 - 2 * S>(h[0]), vi_set1_8(0x10));
    hi = vi_or_and(hi, vi_shift16<3 - 2 * S>(h[0]), vi_set1_8(0x10));
  } else if constexpr (QT == kQ6_K) {  // bits 2p, 2p + 1 of h[t / 4] to bits 4-5, p = t % 4
    constexpr int p = 2 * S % 4;
    lo = vi_or_and(lo, vi_shift16<4 - 2 * p>(h[S / 2]), vi_set1_8(0x30));
    hi = vi_or_and(hi, vi_shift16<2 - 2 * p>(h[S / 2]), vi_set1_8(0x30));
  }
}

template <typename F, int... I>
inline void unrolled(const F& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, typename F>
inline void unrolled(const F& f) {  // f(0), ..., f(N - 1) as compile-time constants
  unrolled(f, std::make_integer_sequence<int, N>{});
}

// Chunk c (sub-block j of its super-block) of MR rows of x x G groups, added to acc; head: each group's
// super-block, d and dmin its scales as float32.
template <int QT, int MR, int G>
inline void chunk(const QRow& xq, int64_t m0, int64_t K, int64_t c, int j, const uint8_t* const* head, const V* d,
                  const V* dmin, V (&acc)[MR][G]) {
  using L = KLayout<QT>;
  constexpr int kSpanPairs = 4 / L::kSpans;  // pairs of quads under one scale
  const int64_t chunks = K / 32;
  const uint8_t* v[G];
  VI h[G][2];
  for (int g = 0; g < G; ++g) {
    v[g] = head[g] + L::kHead + j * L::kChunk;
    if constexpr (L::kHigh >= kQuad) h[g][0] = vi_load(v[g] + 16 * kGroup);
    if constexpr (L::kHigh >= 2 * kQuad) h[g][1] = vi_load(v[g] + 16 * kGroup + kQuad);
  }
  const int32_t* xs[MR];
  for (int r = 0; r < MR; ++r) xs[r] = reinterpret_cast<const int32_t*>(xq.q.data() + (m0 + r) * K + c * 32);
  unrolled<L::kSpans>([&](auto span) {
    constexpr int kSpan = decltype(span)::value;
    VI isum[MR][G], run[MR][G];
    for (int r = 0; r < MR; ++r) {
      // Q6_K's zero point: u . x - 32 sum(x over the span), exact in int32
      const int64_t i = (m0 + r) * chunks + c;
      const int32_t xsum = kSpan == 0 ? xq.sum16[i] : xq.sum[i] - xq.sum16[i];
      for (int g = 0; g < G; ++g) isum[r][g] = L::kZeroPoint ? vi_bcast(-L::kZeroPoint * xsum) : vi_zero();
      for (int g = 0; g < G; ++g) run[r][g] = vi_zero();
    }
    unrolled<kSpanPairs>([&](auto pair) {
      constexpr int S = kSpan * kSpanPairs + decltype(pair)::value;
      VI lo[G], hi[G];
      for (int g = 0; g < G; ++g) quad_pair<QT, S>(v[g], h[g], lo[g], hi[g]);
      for (int r = 0; r < MR; ++r) {
        const VI xl = vi_bcast(xs[r][2 * S]), xh = vi_bcast(xs[r][2 * S + 1]);  // one broadcast for every group
        for (int g = 0; g < G; ++g) {
          if constexpr (kVnni) isum[r][g] = vi_dot(vi_dot(isum[r][g], lo[g], xl), hi[g], xh);
          else run[r][g] = vi_dot16(vi_dot16(run[r][g], lo[g], xl), hi[g], xh);
        }
      }
      if constexpr (!kVnni && (decltype(pair)::value + 1) % L::kRunPairs == 0)  // int16 sums widened per run
        for (int r = 0; r < MR; ++r)
          for (int g = 0; g < G; ++g) isum[r][g] = vi_add(isum[r][g], vi_widen(run[r][g])), run[r][g] = vi_zero();
    });
    for (int g = 0; g < G; ++g) {  // the group's scales: a byte per row to float32, times the super-block's d
      V scale, offset = vzero();
      if constexpr (QT == kQ6_K) {
        scale = vmul(vload(reinterpret_cast<const int8_t*>(head[g]) + (2 * j + kSpan) * kGroup), d[g]);
      } else {
        scale = vmul(vload(head[g] + (4 + j) * kGroup), d[g]);
        offset = vmul(vload(head[g] + (12 + j) * kGroup), dmin[g]);
      }
      for (int r = 0; r < MR; ++r) {
        const int64_t i = (m0 + r) * chunks + c;
        acc[r][g] = vfma(vcvt_i32(isum[r][g]), vmul(scale, vset1(xq.d[i])), acc[r][g]);
        if constexpr (QT != kQ6_K) acc[r][g] = vfma(offset, vset1(-xq.s[i]), acc[r][g]);  // - dmin min d_x sum(x)
      }
    }
  });
}

// MR rows of x x G groups of kGroup output features, every chunk of K. Flattened: every call inside inlined (GCC
// left chunk's lambdas out of line for Q6_K, their registers spilled: 2.5x the time).
// On Intel (stream_prefetch, quant.h) each group's stream is read kAheadSupers super-blocks ahead with software
// prefetches: the hardware prefetchers alone kept too few lines in flight (1.7B shape's Q4_K_M at batch 1 on the
// 2-core AMX Xeon, alternating runs: 15.4-17.0 -> 16.5-20.1 tok/s; 1 super-block ahead 17.0-18.1, 4 ahead 15.4-17.7)
constexpr int64_t kAheadSupers = 2;
template <int QT, int MR, int G, typename T>
__attribute__((flatten)) void tile(const QRow& xq, int64_t m0, const uint8_t* w, int64_t group_bytes, int64_t g0,
                                   int64_t N, int64_t K, T* out, int64_t ldc) {
  using L = KLayout<QT>;
  V acc[MR][G];
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = vzero();
  const int64_t supers = K / 256;
  const int64_t prefetch_until = stream_prefetch() ? supers - kAheadSupers : 0;
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* head[G];
    V d[G], dmin[G];  // loaded once for the super-block's 8 chunks (measured: -7% time at batch 1)
    for (int g = 0; g < G; ++g) {
      head[g] = w + (g0 + g) * group_bytes + sb * L::kSuper;
      if (sb < prefetch_until)  // (the group's own stream only: its last super-blocks are not prefetched)
        for (int64_t off = 0; off < L::kSuper; off += 64)
          __builtin_prefetch(head[g] + kAheadSupers * L::kSuper + off, 0, 3);
      d[g] = vload(reinterpret_cast<const f16*>(head[g] + (QT == kQ6_K ? 16 * kGroup : 0)));
      dmin[g] = QT == kQ6_K ? vzero() : vload(reinterpret_cast<const f16*>(head[g] + 2 * kGroup));
    }
    for (int j = 0; j < 8; ++j) chunk<QT, MR, G>(xq, m0, K, sb * 8 + j, j, head, d, dmin, acc);
  }
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < G; ++g) {
      const int64_t n0 = (g0 + g) * kGroup;
      T* dst = out + (m0 + r) * ldc + n0;
      if (n0 + kGroup <= N) vstore(dst, acc[r][g]);
      else vstore_n(dst, acc[r][g], static_cast<int>(N - n0));
    }
}

template <int QT, typename T>
void gemm(const QRow& q, const uint8_t* w, T* out, int64_t ldc, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t groups = (N + kGroup - 1) / kGroup, group_bytes = K / 256 * KLayout<QT>::kSuper;
  packed_units(M, groups, threads, [&](auto mr, auto gs, int64_t m, int64_t g) {
    tile<QT, decltype(mr)::value, decltype(gs)::value>(q, m, w, group_bytes, g, N, K, out, ldc);
  });
}

template <int QT>
void chunk_values(const uint8_t* w, int64_t n, int64_t c, int64_t K, float* y) {
  using L = KLayout<QT>;
  const uint8_t* head = w + n / kGroup * (K / 256) * L::kSuper + c / 8 * L::kSuper;
  const uint8_t* v = head + L::kHead + c % 8 * L::kChunk;
  const int j = static_cast<int>(n % kGroup), sub = static_cast<int>(c % 8);
  for (int k = 0; k < 32; ++k) {
    const int t = k / 4;
    const int64_t pos = 4 * j + k % 4;
    int q = v[t / 2 * kQuad + pos] >> (4 * (t % 2)) & 0x0F;
    if (QT == kQ5_K) q |= (v[16 * kGroup + pos] >> t & 1) << 4;
    if (QT == kQ6_K) q |= (v[16 * kGroup + t / 4 * kQuad + pos] >> (2 * (t % 4)) & 3) << 4;
    if constexpr (QT == kQ6_K) {  // gguf's order: (d scale) (q - 32)
      const float scale = half(head + 16 * kGroup + 2 * j) * static_cast<int8_t>(head[(2 * sub + k / 16) * kGroup + j]);
      y[k] = scale * static_cast<float>(q - 32);
    } else {  // (d scale) q - dmin min
      const float scale = half(head + 2 * j) * head[(4 + sub) * kGroup + j];
      const float offset = half(head + 2 * kGroup + 2 * j) * head[(12 + sub) * kGroup + j];
      y[k] = scale * static_cast<float>(q) - offset;
    }
  }
}

template <typename Fn>
void with_k(int qtype, const Fn& fn) {
  switch (qtype) {
    case kQ4_K: fn(std::integral_constant<int, kQ4_K>{}); break;
    case kQ5_K: fn(std::integral_constant<int, kQ5_K>{}); break;
    default: fn(std::integral_constant<int, kQ6_K>{}); break;  // the callers (quant.cpp) pass only K-quants
  }
}
}  // namespace

int64_t k_packed_bytes(int qtype, int64_t N, int64_t K) {
  int64_t size = 0;
  with_k(qtype, [&](auto qt) { size = (N + kGroup - 1) / kGroup * (K / 256) * KLayout<decltype(qt)::value>::kSuper; });
  return size;
}

void k_pack(int qtype, const uint8_t* raw, uint8_t* out, int64_t N, int64_t K, int threads) {
  with_k(qtype, [&](auto qt) { pack<decltype(qt)::value>(raw, out, N, K, threads); });
}

template <typename T>
void k_packed_gemm(int qtype, const QRow& q, const uint8_t* w, T* out, int64_t ldc, int64_t M, int64_t N, int64_t K,
                   int threads) {
  with_k(qtype, [&](auto qt) { gemm<decltype(qt)::value, T>(q, w, out, ldc, M, N, K, threads); });
}
template void k_packed_gemm<float>(int, const QRow&, const uint8_t*, float*, int64_t, int64_t, int64_t, int64_t, int);
template void k_packed_gemm<bf16>(int, const QRow&, const uint8_t*, bf16*, int64_t, int64_t, int64_t, int64_t, int);
template void k_packed_gemm<f16>(int, const QRow&, const uint8_t*, f16*, int64_t, int64_t, int64_t, int64_t, int);

void k_packed_chunk(int qtype, const uint8_t* w, int64_t n, int64_t c, int64_t K, float* y) {
  with_k(qtype, [&](auto qt) { chunk_values<decltype(qt)::value>(w, n, c, K, y); });
}

}  // namespace pl::quant
