// The int8 KV cache (kv_cache_dtype="int8"): K/V slot writes that quantize, and paged attention
// that reads the quantized blocks in place. Half the bytes of a bf16 cache per token, so about
// twice the blocks in the same memory, and half the bytes each decode step reads back.
//
// Every (block, KV head) is bs * (D + 2) bytes: bs * D int8 values, then bs f16 scales, one per
// slot: x ~ scale * q with scale = f16(max |x| / 127) over the slot's D values and q = round(x /
// scale) in [-127, 127]. A scale per slot (not per block) lets a block fill one token at a time
// without re-rounding the slots written before; it costs 2 bytes per D values.
// - K is stored dim-major, (D, bs): dim d of every slot side by side, so one load holds dim d of
//   a run of kLanes tokens and q.k grows a run's scores by FMAs against broadcast q values;
// - V is stored as (bs, D) token rows, read by P.V like the float cache, with each token's weight
//   multiplied by its scale first.
// Quantized values are converted to float32 in registers (vpmovsxbd + vcvtdq2ps) and the
// arithmetic is float32, at every level. Blocks of a multiple of kLanes tokens with D a multiple
// of kLanes take the vector path, any other shape a scalar loop. pagedllm/attention/kv_quant.py
// writes and reads the same layout in torch (the reference the tests compare against). Tasks are
// shared between threads as in attention.cpp, long ones split over their KV blocks when too few
// for the threads (attention.h's split-KV plan and merge). The rows of a prompt chunk attend in tiles
// on attention.cpp's paths over their window dequantized into the model's type (see "prompt tiles").
#include "amx.h"
#include "attention.h"

namespace {
using namespace pl;

struct I8Shape {
  Shape s;             // block_stride: bytes of one block across all KV heads
  int64_t head_bytes;  // bytes of one (block, head): bs * (D + 2)
};

inline const int8_t* head_block(const int8_t* cache, const int32_t* table, int64_t i, const I8Shape& g, int64_t h) {
  return cache + static_cast<int64_t>(table[i]) * g.s.block_stride + h * g.head_bytes;
}
inline const f16* slot_scales(const int8_t* head, const Shape& s) {
  return reinterpret_cast<const f16*>(head + s.D * s.bs);
}

// Quantizes D values of one slot into dst[d * step] and returns the slot's scale.
template <typename T>
inline f16 quantize_slot(const T* src, int8_t* dst, int64_t D, int64_t step) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_f32(src[d])));
  const f16 scale = from_f32<f16>(std::min(amax / 127.f, 65504.f));  // the largest finite f16
  const float s = to_f32(scale);
  for (int64_t d = 0; d < D; ++d) {
    const float x = s > 0.f ? to_f32(src[d]) / s : 0.f;  // a division, as torch's reference does
    dst[d * step] = static_cast<int8_t>(std::lrint(std::min(127.f, std::max(-127.f, x))));  // NaN -> -127
  }
  return scale;
}

// ------------------------------------------------------------------ scalar path (any shape)
// One task (or piece: w its window): out its group x D output rows, or with `part` the piece's partial
// result (attention.h) instead.
template <typename T>
void task_scalar(const T* q, const int8_t* kc, const int8_t* vc, const Window& w, int64_t h, const I8Shape& g, T* out,
                 float* part, std::vector<float>& scores) {
  const Shape& s = g.s;
  const int64_t D = s.D, bs = s.bs, len = w.len;
  scores.resize(s.group * len);
  for (int64_t t = 0; t < len; ++t) {
    const int8_t* kb = head_block(kc, w.table, t / bs, g, h);
    const float ks = to_f32(slot_scales(kb, s)[t % bs]) * s.scale;
    for (int64_t j = 0; j < s.group; ++j) {
      float dot = 0.f;
      for (int64_t d = 0; d < D; ++d) dot += to_f32(q[j * D + d]) * kb[d * bs + t % bs];
      scores[j * len + t] = dot * ks;
    }
  }
  finish_scores(scores.data(), s.group, len, w.masked, s.softcap);
  if (part) exp_rows(scores.data(), s.group, len, part, D);
  else softmax_rows(scores.data(), s.group, len);
  std::vector<float> acc(D);
  for (int64_t j = 0; j < s.group; ++j) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t = 0; t < len; ++t) {
      const int8_t* vb = head_block(vc, w.table, t / bs, g, h);
      const float p = scores[j * len + t] * to_f32(slot_scales(vb, s)[t % bs]);
      for (int64_t d = 0; d < D; ++d) acc[d] += p * vb[(t % bs) * D + d];
    }
    for (int64_t d = 0; d < D; ++d)
      if (part) part[j * D + d] = acc[d];
      else out[j * D + d] = from_f32<T>(acc[d]);
  }
}

// ------------------------------------------------------------------ vector path
#ifdef PL_AVX512
constexpr int kRuns = 4;  // runs of kLanes tokens per q.k tile: up to 4 heads x 4 runs accumulators
#else
constexpr int kRuns = 2;
#endif

// acc[j][r] = q_j . k over the kLanes tokens of run r, for kG heads (q: kG x D float32).
template <int kG, int kR>
inline void qk_tile(const float* q, int64_t D, const int8_t* const* runs, int64_t bs, V (*acc)[kRuns]) {
  V a[kG][kR];
  for (int j = 0; j < kG; ++j)
    for (int r = 0; r < kR; ++r) a[j][r] = vzero();
  for (int64_t d = 0; d < D; ++d) {
    V k[kR];
    for (int r = 0; r < kR; ++r) k[r] = vload(runs[r] + d * bs);
    for (int j = 0; j < kG; ++j) {
      const V qd = vset1(q[j * D + d]);
      for (int r = 0; r < kR; ++r) a[j][r] = vfma(qd, k[r], a[j][r]);
    }
  }
  for (int j = 0; j < kG; ++j)
    for (int r = 0; r < kR; ++r) acc[j][r] = a[j][r];
}

template <int kR>
inline void qk_heads(const float* q, int64_t D, const int8_t* const* runs, int64_t bs, int64_t heads, V (*acc)[kRuns]) {
  switch (heads) {
    case 1: qk_tile<1, kR>(q, D, runs, bs, acc); break;
    case 2: qk_tile<2, kR>(q, D, runs, bs, acc); break;
    case 3: qk_tile<3, kR>(q, D, runs, bs, acc); break;
    default: qk_tile<4, kR>(q, D, runs, bs, acc); break;
  }
}

// scores[j * len + t] = scale * k_scale[t] * q_j . k_t for the task's group of heads.
void qk(const float* q, const int8_t* kc, const Window& w, int64_t h, const I8Shape& g, float* scores) {
  const Shape& s = g.s;
  const int64_t bs = s.bs, len = w.len, kRun = kRuns * kLanes;
  for (int64_t t0 = 0; t0 < len; t0 += kRun) {
    const int64_t n = std::min(kRun, len - t0), runs_n = (n + kLanes - 1) / kLanes;
    const int8_t* runs[kRuns];
    V kscale[kRuns];
    for (int64_t r = 0; r < runs_n; ++r) {
      const int64_t t = t0 + r * kLanes;
      const int8_t* head = head_block(kc, w.table, t / bs, g, h);
      if (t % bs == 0 && t + 2 * bs < len)  // the block two ahead loads while this one computes
        prefetch_bytes(head_block(kc, w.table, t / bs + 2, g, h), g.head_bytes);
      runs[r] = head + t % bs;
      kscale[r] = vmul(vload(slot_scales(head, s) + t % bs), vset1(s.scale));
    }
    for (int64_t j0 = 0; j0 < s.group; j0 += 4) {
      V acc[4][kRuns];
      const int64_t heads = std::min<int64_t>(4, s.group - j0);
      switch (runs_n) {
        case 1: qk_heads<1>(q + j0 * s.D, s.D, runs, bs, heads, acc); break;
#ifdef PL_AVX512
        case 2: qk_heads<2>(q + j0 * s.D, s.D, runs, bs, heads, acc); break;
        case 3: qk_heads<3>(q + j0 * s.D, s.D, runs, bs, heads, acc); break;
#endif
        default: qk_heads<kRuns>(q + j0 * s.D, s.D, runs, bs, heads, acc); break;
      }
      for (int64_t j = j0; j < j0 + heads; ++j)
        for (int64_t r = 0; r < runs_n; ++r) {
          const int64_t left = n - r * kLanes;
          const V v = vmul(acc[j - j0][r], kscale[r]);
          float* dst = scores + j * len + t0 + r * kLanes;
          if (left >= kLanes) vstore(dst, v);
          else vstore_n(dst, v, static_cast<int>(left));
        }
    }
  }
}

// out_j[d0 .. d0 + kC * kLanes) = sum_t p[j * len + t] * v_t for kG heads (p already holds the V scales);
// out in the storage type (a whole task) or float32 (a piece's partial result).
template <int kC, int kG, typename O>
void pv_tile(const float* p, const int8_t* vc, const Window& w, int64_t h, const I8Shape& g, int64_t d0, O* out) {
  const Shape& s = g.s;
  const int64_t bs = s.bs, D = s.D, len = w.len;
  V acc[kG][kC];
  for (int j = 0; j < kG; ++j)
    for (int c = 0; c < kC; ++c) acc[j][c] = vzero();
  for (int64_t t0 = 0; t0 < len; t0 += bs) {
    const int8_t* head = head_block(vc, w.table, t0 / bs, g, h) + d0;
    if (d0 == 0 && t0 + 2 * bs < len) prefetch_bytes(head_block(vc, w.table, t0 / bs + 2, g, h), g.head_bytes);
    const int64_t n = std::min(bs, len - t0);
    for (int64_t o = 0; o < n; ++o) {
      V v[kC];
      for (int c = 0; c < kC; ++c) v[c] = vload(head + o * D + c * kLanes);
      for (int j = 0; j < kG; ++j) {
        const V wt = vset1(p[j * len + t0 + o]);
        for (int c = 0; c < kC; ++c) acc[j][c] = vfma(wt, v[c], acc[j][c]);
      }
    }
  }
  for (int j = 0; j < kG; ++j)
    for (int c = 0; c < kC; ++c) vstore(out + j * D + d0 + c * kLanes, acc[j][c]);
}

#ifdef PL_AVX512
constexpr int kMaxG = 4;  // 4 heads x 4 vectors of sums + 4 loaded of 32 registers
#else
constexpr int kMaxG = 3;  // 3 x 4 + 4 of 16
#endif

template <int kC, typename O>
void pv_chunk(const float* p, const int8_t* vc, const Window& w, int64_t h, const I8Shape& g, int64_t d0, O* out) {
  const int64_t len = w.len;
  for (int64_t j0 = 0; j0 < g.s.group; j0 += kMaxG) {
    const float* pj = p + j0 * len;
    O* oj = out + j0 * g.s.D;
    switch (std::min<int64_t>(kMaxG, g.s.group - j0)) {
      case 1: pv_tile<kC, 1>(pj, vc, w, h, g, d0, oj); break;
      case 2: pv_tile<kC, 2>(pj, vc, w, h, g, d0, oj); break;
      case 3: pv_tile<kC, 3>(pj, vc, w, h, g, d0, oj); break;
      default: pv_tile<kC, kMaxG>(pj, vc, w, h, g, d0, oj); break;
    }
  }
}

template <typename O>
void pv(const float* p, const int8_t* vc, const Window& w, int64_t h, const I8Shape& g, O* out) {
  const int64_t D = g.s.D;
  int64_t d0 = 0;
  for (; d0 + 4 * kLanes <= D; d0 += 4 * kLanes) pv_chunk<4>(p, vc, w, h, g, d0, out);
  switch ((D - d0) / kLanes) {
    case 1: pv_chunk<1>(p, vc, w, h, g, d0, out); break;
    case 2: pv_chunk<2>(p, vc, w, h, g, d0, out); break;
    case 3: pv_chunk<3>(p, vc, w, h, g, d0, out); break;
    default: break;
  }
}

// One task (or piece) on the vector path: out its output rows, or with `part` its partial result.
template <typename T>
void task_vector(const T* q, const int8_t* kc, const int8_t* vc, const Window& w, int64_t h, const I8Shape& g, T* out,
                 float* part, std::vector<float>& qf, std::vector<float>& scores) {
  const Shape& s = g.s;
  const int64_t D = s.D, bs = s.bs, len = w.len;
  for (int64_t i = 0; i < s.group * D; ++i) qf[i] = to_f32(q[i]);
  scores.resize(s.group * len);
  qk(qf.data(), kc, w, h, g, scores.data());
  finish_scores(scores.data(), s.group, len, w.masked, s.softcap);
  if (part) exp_rows(scores.data(), s.group, len, part, D);
  else softmax_rows(scores.data(), s.group, len);
  for (int64_t t0 = 0; t0 < len; t0 += bs) {  // each token's weight times its V scale
    const f16* vs = slot_scales(head_block(vc, w.table, t0 / bs, g, h), s);
    const int64_t n = std::min(bs, len - t0);
    for (int64_t o = 0; o < n; ++o) {
      const float f = to_f32(vs[o]);
      for (int64_t j = 0; j < s.group; ++j) scores[j * len + t0 + o] *= f;
    }
  }
  if (part) pv(scores.data(), vc, w, h, g, part);
  else pv(scores.data(), vc, w, h, g, out);
}

// ------------------------------------------------------------------ prompt tiles
// A prompt chunk's rows attend in tiles on attention.cpp's paths (fused flash attention, AMX tiles at "amx") over
// the window's blocks dequantized into the model's type: row by row, a 4k-token prompt read the whole window's K/V
// again for every row. A thread keeps the blocks it dequantized for one KV head and table while its tasks (KV head
// by KV head, a prompt's tiles in order) read them again, so each block is converted about once a call.
template <typename T>
struct Dequantized {
  std::vector<T> k, v;          // one head's blocks in the model type's cache layout (block stride bs x D)
  std::vector<int32_t> ids;     // the int8 blocks they hold, in order (from the window's first block)
  std::vector<int64_t> filled;  // slots converted in each (the rest zero)
  std::vector<int32_t> table;   // logical block i -> i - first (the rows' tables, read by attend_prompt_tile)
  int64_t h = -1, first = -1;
  Scratch sc;
  std::vector<float> qf, scores;  // a lone row's (the row path)
};

// Blocks [first, first + nb) of `table` (a row's whole table) for KV head h, all their slots filled but
// `last_slots` in the last: K as (D / 2, bs, 2) pairs, V as (bs, D) rows of x = scale x q (vector path shapes: bs
// and D multiples of kLanes).
template <typename T>
void dequantize_window(const int8_t* kc, const int8_t* vc, const int32_t* table, int64_t first, int64_t nb,
                       int64_t last_slots, int64_t h, const I8Shape& g, int64_t maxb, Dequantized<T>& d) {
  const Shape& s = g.s;
  const int64_t bs = s.bs, D = s.D, per = bs * D;
  if (d.h != h || d.first != first) d.ids.clear(), d.filled.clear();
  d.h = h, d.first = first;
  int64_t keep = 0;  // blocks already held: same int8 block, at least as many slots
  while (keep < static_cast<int64_t>(d.ids.size()) && keep < nb && d.ids[keep] == table[first + keep] &&
         d.filled[keep] >= (keep + 1 < nb ? bs : last_slots))
    ++keep;
  d.ids.resize(nb), d.filled.resize(nb);
  if (static_cast<int64_t>(d.k.size()) < nb * per) d.k.resize(nb * per), d.v.resize(nb * per);
  for (int64_t i = keep; i < nb; ++i) {
    const int64_t n = i + 1 < nb ? bs : last_slots;
    const int8_t* kb = head_block(kc, table + first, i, g, h);
    const int8_t* vb = head_block(vc, table + first, i, g, h);
    const f16* kscale = slot_scales(kb, s);
    const f16* vscale = slot_scales(vb, s);
    T* kd = d.k.data() + i * per;
    T* vd = d.v.data() + i * per;
    for (int64_t t0 = 0; t0 < bs; t0 += kLanes) {  // K: kLanes tokens of dims 2p, 2p + 1 interleaved into pairs
      const V ks = vload_n(kscale + t0, static_cast<int>(std::clamp<int64_t>(n - t0, 0, kLanes)));  // 0 past n
      for (int64_t p = 0; p < D / 2; ++p) {
        V lo, hi;
        vinterleave(vmul(vload(kb + 2 * p * bs + t0), ks), vmul(vload(kb + (2 * p + 1) * bs + t0), ks), lo, hi);
        vstore(kd + (p * bs + t0) * 2, lo);
        vstore(kd + (p * bs + t0) * 2 + kLanes, hi);
      }
    }
    for (int64_t t = 0; t < n; ++t) {  // V: token rows times their scale
      const V vs = vset1(to_f32(vscale[t]));
      for (int64_t x = 0; x < D; x += kLanes) vstore(vd + t * D + x, vmul(vload(vb + t * D + x), vs));
    }
    std::fill(vd + n * D, vd + per, from_f32<T>(0.f));  // slots past the window's end: zeros, not the cache's bytes
    d.ids[i] = table[first + i], d.filled[i] = n;
  }
  d.table.resize(maxb);
  for (int64_t i = 0; i < maxb; ++i) d.table[i] = static_cast<int32_t>(std::max<int64_t>(0, i - first));
}

// One (tile, KV head) task: the window of the tile's last row (the widest) dequantized, then attended.
template <typename T>
void tile_i8(const T* q, const int8_t* kc, const int8_t* vc, const int32_t* tables, const int32_t* lens,
             const int32_t* starts, const Tile& tile, int64_t h, const I8Shape& g, T* out, Dequantized<T>& d) {
  const Shape& s = g.s;
  const int64_t last = tile.row + tile.rows - 1;
  const int64_t first = (starts == nullptr || starts[tile.row] <= 0) ? 0 : starts[tile.row] / s.bs;
  const int64_t end_block = (lens[last] + s.bs - 1) / s.bs;
  const int64_t last_slots = lens[last] - (end_block - 1) * s.bs;
  dequantize_window<T>(kc, vc, tables + last * s.maxb, first, end_block - first, last_slots, h, g, s.maxb, d);
  attend_prompt_tile<T>(q, d.k.data(), d.v.data(), d.table.data(), lens, starts, tile, h, s, out, d.sc);
}

template <typename T>
void attend(const T* q, const int8_t* kc, const int8_t* vc, const int32_t* tables, const int32_t* lens,
            const int32_t* starts, T* out, int64_t rows, const I8Shape& g, int threads, int split) {
  const Shape& s = g.s;
  const bool vector = s.bs % kLanes == 0 && s.D % kLanes == 0;  // runs never straddle a block; whole vectors
  // one task or piece: w its window, out its output rows or part its partial result
  auto run = [&](int64_t task, const Window& w, float* part, std::vector<float>& qf, std::vector<float>& scores) {
    const int64_t seq = task / s.nkv, h = task % s.nkv;
    const T* qrow = q + seq * s.q_stride + h * s.group * s.D;
    T* orow = out + (seq * s.nh + h * s.group) * s.D;
    if (vector) task_vector<T>(qrow, kc, vc, w, h, g, orow, part, qf, scores);
    else task_scalar<T>(qrow, kc, vc, w, h, g, orow, part, scores);
  };
  if (vector && (s.D == 64 || s.D == 128) && !(split & kNoTiles)) {
    const std::vector<Tile> tiles = find_tiles(
        tables, lens, starts, rows, s, std::max<int64_t>(1, (s.amx ? kAmxTileVectors : kTileVectors) / s.group));
    if (!tiles.empty()) {
      run_tiles<Dequantized<T>>(tiles, lens, starts, s, threads, [&](const Tile& t, int64_t h, Dequantized<T>& d) {
        if (t.rows > 1) return tile_i8<T>(q, kc, vc, tables, lens, starts, t, h, g, out, d);
        d.qf.resize(s.group * s.D);
        run(t.row * s.nkv + h, window_of(tables, lens, starts, t.row, s), nullptr, d.qf, d.scores);
      });
      return;
    }
  }
  const SplitPlan plan = plan_split(lens, starts, rows, s.nkv, s.bs, threads, split);
  if (plan.pieces.empty()) {
    parallel_by_length(lens, s.nkv, rows * s.nkv, threads, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, qf(s.group * s.D);
      for (int64_t task = begin; task < end; ++task)
        run(task, window_of(tables, lens, starts, task / s.nkv, s), nullptr, qf, scores);
    });
    return;
  }
  const int64_t stride = partial_floats(s.group, s.D);
  std::vector<float> parts(plan.slots * stride);
  run_split(
      plan,
      [&](int64_t begin, int64_t end) {
        std::vector<float> scores, qf(s.group * s.D);
        for (int64_t i = begin; i < end; ++i) {
          const Piece& p = plan.pieces[i];
          const Window w = piece_window(window_of(tables, lens, starts, p.task / s.nkv, s), p.begin, p.end, s.bs);
          run(p.task, w, p.slot < 0 ? nullptr : parts.data() + p.slot * stride, qf, scores);
        }
      },
      [&](const Merge& m) {
        const int64_t seq = m.task / s.nkv, h = m.task % s.nkv;
        merge_partials<T>(parts.data() + m.first * stride, m.count, s.group, s.D,
                          out + (seq * s.nh + h * s.group) * s.D);
      });
}
}  // namespace

// q (rows, nh, D) in `dtype`, row stride q_stride, heads contiguous; key/value caches int8 as laid out
// above (blocks, nkv, bs * (D + 2) bytes); tables, lens, starts, softcap and out as for
// pl_paged_attention_window (split included).
PL_EXPORT int pl_paged_attention_i8(const void* q, int64_t q_stride, const void* kc, const void* vc,
                                    const int32_t* tables, int64_t maxb, const int32_t* lens, const int32_t* starts,
                                    void* out, int64_t rows, int64_t nh, int64_t nkv, int64_t bs, int64_t D,
                                    float scale, float softcap, int dtype, int threads, int split) {
  if (nkv <= 0 || nh % nkv != 0 || D % 2) {
    pl::set_error("query heads (%lld) must be a multiple of KV heads (%lld), head_dim (%lld) even",
                  static_cast<long long>(nh), static_cast<long long>(nkv), static_cast<long long>(D));
    return -1;
  }
  const int64_t head_bytes = bs * (D + 2);
  I8Shape g{Shape{nh, nkv, D, bs, maxb, q_stride, nh / nkv, nkv * head_bytes, scale, softcap}, head_bytes};
#ifdef PL_AMX
  g.s.amx = (split & kAmxTiles) && dtype == pl::kBF16 && pl::amx_permitted();  // bf16 prompt tiles on AMX tiles
#endif
  return pl::with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    attend<T>(static_cast<const T*>(q), static_cast<const int8_t*>(kc), static_cast<const int8_t*>(vc), tables, lens,
              starts, static_cast<T*>(out), rows, g, threads, split);
    return 0;
  });
}

// Quantizes each new token's K and V (tokens, nkv, D in `dtype`; row strides ks / vs, head strides
// khs / vhs, in elements) into its slot of the int8 caches: block slot / bs, offset slot % bs.
PL_EXPORT int pl_write_kv_i8(const void* k, int64_t ks, int64_t khs, const void* v, int64_t vs, int64_t vhs, void* kc,
                             void* vc, const int64_t* slots, int64_t tokens, int64_t nkv, int64_t bs, int64_t D,
                             int64_t blocks, int dtype, int threads) {
  if (!pl::check_kv_write(slots, tokens, bs, D, blocks)) return -1;
  const int64_t head_bytes = bs * (D + 2);
  return pl::with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* kp = static_cast<const T*>(k);
    const T* vp = static_cast<const T*>(v);
    pl::parallel_for(tokens, threads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b = slots[t] / bs, o = slots[t] % bs;
        for (int64_t h = 0; h < nkv; ++h) {
          int8_t* kh = static_cast<int8_t*>(kc) + (b * nkv + h) * head_bytes;
          int8_t* vh = static_cast<int8_t*>(vc) + (b * nkv + h) * head_bytes;
          const f16 kscale = quantize_slot(kp + t * ks + h * khs, kh + o, D, bs);  // dim-major: step bs
          const f16 vscale = quantize_slot(vp + t * vs + h * vhs, vh + o * D, D, 1);
          std::memcpy(kh + D * bs + 2 * o, &kscale, 2);
          std::memcpy(vh + D * bs + 2 * o, &vscale, 2);
        }
      }
    });
    return 0;
  });
}
