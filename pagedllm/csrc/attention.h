// What the paged attention kernels share (attention.cpp for the model's storage type, kv_int8.cpp for
// the int8 KV cache): the split of (row, KV head) tasks between threads, a row's sliding window,
// the soft cap and the softmax over a task's scores, and split-KV: a long task cut into pieces of
// its KV blocks that threads run apart, whose partial results one merge combines.
#pragma once
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include "amx.h"
#include "common.h"

namespace pl {

inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// One run of `len` scores becomes exp(score - max), in place; returns its max and sets `total` to the sum.
inline float exp_row(float* s, int64_t len, float& total) {
  V vmx = vset1(-INFINITY);
  int64_t t = 0;
  for (; t + kLanes <= len; t += kLanes) vmx = vmax(vmx, vload(s + t));
  float top = vmaxval(vmx);
  for (; t < len; ++t) top = std::max(top, s[t]);
  const V vtop = vset1(top);
  V vtotal = vzero();
  for (t = 0; t + kLanes <= len; t += kLanes) {
    const V e = vexp(vsub(vload(s + t), vtop));
    vstore(s + t, e);
    vtotal = vadd(vtotal, e);
  }
  if (t < len) {
    const int n = static_cast<int>(len - t);
    const V e = vexp(vsub(vload_n(s + t, n, -INFINITY), vtop));  // lanes past the end: exp(-inf) = 0
    vstore_n(s + t, e, n);
    vtotal = vadd(vtotal, e);
  }
  total = vsum(vtotal);
  return top;
}

// Each of the `rows` runs of `len` scores becomes its softmax, in place.
inline void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * len;
    float total;
    exp_row(s, len, total);
    const V inv = vset1(1.f / total);
    int64_t t = 0;
    for (; t + kLanes <= len; t += kLanes) vstore(s + t, vmul(vload(s + t), inv));
    if (t < len) vstore_n(s + t, vmul(vload_n(s + t, static_cast<int>(len - t)), inv), static_cast<int>(len - t));
  }
}

// Splits tasks into one contiguous range per thread with about equal total cost (cum: the running sum
// of the tasks' costs, items + 1 entries from 0), and runs fn(begin, end) on each.
template <typename Fn>
void parallel_by_cost(const std::vector<int64_t>& cum, int threads, const Fn& fn) {
  const int64_t items = static_cast<int64_t>(cum.size()) - 1;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  auto run = [&](int64_t t) {
    const int64_t begin = std::lower_bound(cum.begin(), cum.end(), cum[items] * t / parts) - cum.begin();
    const int64_t end = std::lower_bound(cum.begin(), cum.end(), cum[items] * (t + 1) / parts) - cum.begin();
    if (begin < end) fn(std::min(begin, items), std::min(end, items));
  };
  if (parts == 1) {
    run(0);
    return;
  }
#pragma omp parallel for num_threads(static_cast<int>(parts)) schedule(static, 1)
  for (int64_t t = 0; t < parts; ++t) run(t);
}

// Splits the (row, KV head) tasks into one contiguous range per thread with about equal total
// context length, and runs fn(begin, end) on each.
template <typename Fn>
void parallel_by_length(const int32_t* lens, int64_t nkv, int64_t items, int threads, const Fn& fn) {
  std::vector<int64_t> cum(items + 1, 0);  // cost of a task: its context length + a fixed overhead
  for (int64_t i = 0; i < items; ++i) cum[i + 1] = cum[i] + lens[i / nkv] + 16;
  parallel_by_cost(cum, threads, fn);
}

// Shapes of one call, shared by every path.
struct Shape {
  int64_t nh, nkv, D, bs, maxb, q_stride, group, block_stride;
  float scale;
  float softcap = 0.f;  // Gemma 2's attention logit soft cap (0: none)
  bool amx = false;     // bf16 prompt tiles on AMX tiles (the "amx" level, the OS granting the tile state)
};

// A row with a sliding window starts at position starts[row]: its table is read from the block
// holding that position (the row sees len - skipped positions) and the `masked` positions before
// the start inside that block get no weight.
struct Window {
  const int32_t* table;
  int64_t len, masked;
};

inline Window window_of(const int32_t* tables, const int32_t* lens, const int32_t* starts, int64_t seq,
                        const Shape& s) {
  const int32_t* table = tables + seq * s.maxb;
  if (starts == nullptr || starts[seq] <= 0) return {table, lens[seq], 0};
  const int64_t skip = starts[seq] / s.bs;
  return {table + skip, lens[seq] - skip * s.bs, starts[seq] - skip * s.bs};
}

// Gemma 2's soft cap (cap * tanh(score / cap), when cap > 0), then the positions before a window's
// start get -inf (softmax gives them weight 0).
inline void finish_scores(float* scores, int64_t group, int64_t len, int64_t masked, float cap) {
  if (cap > 0.f)
    for (int64_t i = 0; i < group * len; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t t = 0; t < masked; ++t) scores[g * len + t] = -std::numeric_limits<float>::infinity();
}

// ------------------------------------------------------------------ split-KV (flash-decoding)
// At batch 1 a step has as many tasks as KV heads (8 for Llama-3.1-8B): on 32 cores, 24 would sit
// idle through a 32k context. When some task is longer than half a thread's share of the work,
// the tasks are laid end to end and cut into one run per thread at equal shares of the total
// length, on block boundaries; a task a cut falls inside is split into pieces. A piece keeps, per
// query head, its max score m, its sum of exp(score - m) l and its unnormalized float32 output o;
// after a barrier the pieces of each task merge: M = max m_c, out = sum_c e^(m_c - M) o_c /
// sum_c e^(m_c - M) l_c. Batches whose tasks cover the threads are never split (bit-identical).

enum SplitMode : int { kSplitAuto = 0, kSplitNever = 1, kSplitAlways = 2 };
constexpr int kNoTiles = 4;   // or-ed into a SplitMode: prompt rows attend row by row (attention.cpp's tiles)
constexpr int kAmxTiles = 8;  // or-ed into a SplitMode: bf16 prompt tiles may run on AMX tiles (the "amx" level)

// A piece shorter than this many tokens (rounded up to whole blocks, at least 2) is not cut off: its
// merge and a cold start of its prefetches would cost more than its share of the work (1 KV head, 2
// threads, 272 tokens in 2 pieces: bf16 1.13x, int8 0.96x; 520 tokens: 1.41x, 1.06x).
constexpr int64_t kMinPieceTokens = 128;

// Tokens [begin, end) of a task's window (begin a multiple of the block size); slot: the index of its
// partial result, or -1 for a whole task, which writes its output rows itself.
struct Piece {
  int64_t task, begin, end, slot;
};

// The pieces of one split task: partial results first .. first + count - 1.
struct Merge {
  int64_t task, first, count;
};

// pieces in task order; thread part t runs pieces [part_start[t], part_start[t + 1]). No pieces: no
// task is split (the caller runs the unsplit path).
struct SplitPlan {
  std::vector<Piece> pieces;
  std::vector<int64_t> part_start;
  std::vector<Merge> merges;
  int64_t slots = 0;
};

// Tokens a row's window covers (from the block holding its start: see window_of).
inline int64_t window_len(const int32_t* lens, const int32_t* starts, int64_t seq, int64_t bs) {
  return lens[seq] - (starts == nullptr || starts[seq] <= 0 ? 0 : starts[seq] / bs * bs);
}

inline SplitPlan plan_split(const int32_t* lens, const int32_t* starts, int64_t rows, int64_t nkv, int64_t bs,
                            int threads, int mode) {
  SplitPlan plan;
  mode &= ~(kNoTiles | kAmxTiles);
  const int64_t items = rows * nkv, parts = threads;
  if (mode == kSplitNever || parts <= 1 || items <= 0) return plan;
  constexpr int64_t kOverhead = 16;  // a task's fixed cost in tokens, as parallel_by_length counts it
  int64_t total = 0, longest = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = window_len(lens, starts, r, bs);
    total += nkv * (len + kOverhead);
    longest = std::max(longest, len + kOverhead);
  }
  // every task within half a share: whole tasks already balance the threads
  if (mode == kSplitAuto && 2 * longest * parts <= total) return plan;
  const int64_t min_piece = std::max<int64_t>(2, (kMinPieceTokens + bs - 1) / bs) * bs;
  auto len_of = [&](int64_t task) { return window_len(lens, starts, task / nkv, bs); };
  std::vector<int64_t> cum(items + 1, 0);
  for (int64_t i = 0; i < items; ++i) cum[i + 1] = cum[i] + len_of(i) + kOverhead;
  // cut t: (task, token offset) where part t begins; offsets stay >= min_piece from the task's ends and
  // from the previous cut inside the same task, and cuts never go backwards
  std::vector<std::pair<int64_t, int64_t>> cuts(parts + 1, {0, 0});
  cuts[parts] = {items, 0};
  for (int64_t t = 1; t < parts; ++t) {
    const int64_t x = total * t / parts;
    const int64_t i = std::min<int64_t>(items - 1, std::upper_bound(cum.begin(), cum.end(), x) - cum.begin() - 1);
    const int64_t len = len_of(i);
    int64_t off = std::min(len, (x - cum[i] + bs / 2) / bs * bs);
    const int64_t lo = cuts[t - 1].first == i ? cuts[t - 1].second : 0;
    if (off - lo < min_piece) off = lo;
    else if (len - off < min_piece) off = len;
    cuts[t] = std::max(cuts[t - 1], off == len ? std::make_pair(i + 1, int64_t{0}) : std::make_pair(i, off));
  }
  plan.part_start.assign(parts + 1, 0);
  bool split = false;
  for (int64_t t = 0; t < parts; ++t) {
    plan.part_start[t] = static_cast<int64_t>(plan.pieces.size());
    const auto [a_task, a_off] = cuts[t];
    const auto [b_task, b_off] = cuts[t + 1];
    for (int64_t task = a_task; task < std::min(items, b_off > 0 ? b_task + 1 : b_task); ++task) {
      const int64_t len = len_of(task), begin = task == a_task ? a_off : 0, end = task == b_task ? b_off : len;
      if (begin >= end) continue;
      split |= begin > 0 || end < len;
      plan.pieces.push_back({task, begin, end, -1});
    }
  }
  plan.part_start[parts] = static_cast<int64_t>(plan.pieces.size());
  if (!split) return SplitPlan{};
  for (Piece& p : plan.pieces)
    if (p.begin > 0 || p.end < len_of(p.task)) {
      if (p.begin == 0) plan.merges.push_back({p.task, plan.slots, 0});  // a split task's first piece
      p.slot = plan.slots++;
      ++plan.merges.back().count;
    }
  return plan;
}

// The window of a piece: the task's window from token `begin` (a block boundary) to `end`; positions
// masked before a sliding window's start lie in the first piece.
inline Window piece_window(const Window& w, int64_t begin, int64_t end, int64_t bs) {
  return {w.table + begin / bs, end - begin, begin == 0 ? w.masked : 0};
}

// Where a piece's partial result lives: per query head of the group, D float32 of unnormalized output,
// then (after all group x D) the head's max score and its sum of exp.
inline int64_t partial_floats(int64_t group, int64_t D) { return group * (D + 2); }

// A piece's scores of `group` heads become exp(score - max) in place; the max and sum of each head go
// beside the partial output (at part + group * D).
inline void exp_rows(float* scores, int64_t group, int64_t len, float* part, int64_t D) {
  float* stats = part + group * D;
  for (int64_t g = 0; g < group; ++g) stats[2 * g] = exp_row(scores + g * len, len, stats[2 * g + 1]);
}

// Combines the `count` partial results of one task into its output rows (group x D).
template <typename T>
void merge_partials(const float* parts, int64_t count, int64_t group, int64_t D, T* out) {
  const int64_t stride = partial_floats(group, D);
  std::vector<float> acc(D), weight(count);
  for (int64_t g = 0; g < group; ++g) {
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < count; ++c) top = std::max(top, parts[c * stride + group * D + 2 * g]);
    float total = 0.f;
    for (int64_t c = 0; c < count; ++c) {
      const float* stats = parts + c * stride + group * D + 2 * g;
      weight[c] = std::exp(stats[0] - top);  // every piece holds a position: its max is finite
      total += weight[c] * stats[1];
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t c = 0; c < count; ++c) {
      const float* o = parts + c * stride + g * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += weight[c] * o[d];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = from_f32<T>(acc[d] * inv);
  }
}

// Runs a plan: pieces(begin, end) for each thread part's range of pieces, then, after every piece is
// done, merge(m) for each split task, the merges shared between the threads.
template <typename PieceFn, typename MergeFn>
void run_split(const SplitPlan& plan, const PieceFn& pieces, const MergeFn& merge) {
  const int64_t parts = static_cast<int64_t>(plan.part_start.size()) - 1;
  const int64_t merges = static_cast<int64_t>(plan.merges.size());
#pragma omp parallel num_threads(static_cast<int>(parts))
  {
    const int64_t n = omp_get_num_threads(), me = omp_get_thread_num();  // the pool may give fewer
    for (int64_t t = me; t < parts; t += n)
      if (plan.part_start[t] < plan.part_start[t + 1]) pieces(plan.part_start[t], plan.part_start[t + 1]);
#pragma omp barrier
    for (int64_t i = merges * me / n; i < merges * (me + 1) / n; ++i) merge(plan.merges[i]);
  }
}

// ------------------------------------------------------------------ prompt tiles (attention.cpp)
// A thread's buffers, reused across its tasks.
struct Scratch {
  std::vector<float> qf, scores, acc, kbuf;
  std::vector<float> tile;  // a prompt tile's query vectors and outputs, in the storage type (float words hold them)
  std::vector<uint16_t> pairs, p16;  // a bf16 tile's V as token pairs and its weights in bf16 (flash_tile_dot)
  std::vector<float> stats;          // a fused tile's running max, sum and rescale per vector
  std::vector<int64_t> bounds;       // a tile's rows' visible positions, [begin, end) each
};

constexpr int64_t kTileVectors = 32;  // two-pass scores: 32 x 4k float32 = 512 KiB a thread, beside one head's K/V
// On AMX tiles, twice as many: K/V and its pair layout are read once per 64 vectors (Llama-3.1-8B's shape, 4k-token
// prompt, one layer: 296 -> 262 ms; 4 tile products of 16 vectors a chunk)
constexpr int64_t kAmxTileVectors = 2 * kTileVectors;
constexpr int64_t kMinTileRows = 4;  // shorter runs of rows (a speculative verify) stay rows: no copies

// Rows [row, row + rows) of one request, each attending to one position more than the row before.
struct Tile {
  int64_t row, rows;
};

// The step's rows cut into tiles of at most `most` rows (a row alone is a tile of one); empty when no
// run of kMinTileRows rows exists (every row then takes the row path, split-KV included).
inline std::vector<Tile> find_tiles(const int32_t* tables, const int32_t* lens, const int32_t* starts, int64_t rows,
                                    const Shape& s, int64_t most) {
  std::vector<Tile> tiles;
  bool any = false;
  for (int64_t r = 0; r < rows;) {
    int64_t end = r + 1;
    for (; end < rows && end - r < most && lens[end] == lens[end - 1] + 1; ++end) {
      const int64_t blocks = (lens[end] + s.bs - 1) / s.bs;  // the entries its window reads (the rest are padding)
      if (std::memcmp(tables + end * s.maxb, tables + (end - 1) * s.maxb, blocks * sizeof(int32_t)) != 0) break;
      if (starts != nullptr && starts[end] < starts[end - 1]) break;
    }
    tiles.push_back({r, end - r});
    any |= end - r >= kMinTileRows;
    r = end;
  }
  if (!any) tiles.clear();
  return tiles;
}

// Every (tile, KV head) task of a step, KV head by KV head (the next tile of a prompt reads the K/V the last one
// left in cache), split between threads by the positions each task scores: task(tile, h, state) with one State a
// thread (its buffers), the thread's AMX tiles configured while it runs tasks (s.amx).
template <typename State, typename TaskFn>
void run_tiles(const std::vector<Tile>& tiles, const int32_t* lens, const int32_t* starts, const Shape& s, int threads,
               const TaskFn& task) {
  const int64_t nt = static_cast<int64_t>(tiles.size()), items = nt * s.nkv;
  std::vector<int64_t> cum(items + 1, 0);
  for (int64_t i = 0; i < items; ++i) {
    const Tile& t = tiles[i % nt];
    cum[i + 1] = cum[i] + t.rows * s.group * (window_len(lens, starts, t.row + t.rows - 1, s.bs) + 16);
  }
  parallel_by_cost(cum, threads, [&](int64_t begin, int64_t end) {
    State state;
#ifdef PL_AMX
    const AmxTiles amx(s.amx);
#endif
    for (int64_t i = begin; i < end; ++i) task(tiles[i % nt], i / nt, state);
  });
}

// One tile of prompt rows and KV head h attended on attention.cpp's tile paths over K/V that the caller laid out
// as the storage type's cache, one head's blocks only (block stride bs x D; kv_int8.cpp dequantizes its blocks
// so): `table` indexed as the rows' own tables are (maxb entries, every row the same), q/out/lens/starts and s
// as for the whole call.
template <typename T>
void attend_prompt_tile(const T* q, const T* kc, const T* vc, const int32_t* table, const int32_t* lens,
                        const int32_t* starts, const Tile& tile, int64_t h, const Shape& s, T* out, Scratch& sc);

// The arguments of a K/V slot write (either cache type), checked before anything is written: an even
// head_dim and every slot inside the cache. False with the error set otherwise.
inline bool check_kv_write(const int64_t* slots, int64_t tokens, int64_t bs, int64_t D, int64_t blocks) {
  if (D % 2) {
    set_error("head_dim must be even, got %lld", static_cast<long long>(D));
    return false;
  }
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] < 0 || slots[t] / bs >= blocks) {
      set_error("slot %lld is outside the KV cache", static_cast<long long>(slots[t]));
      return false;
    }
  return true;
}

}  // namespace pl
