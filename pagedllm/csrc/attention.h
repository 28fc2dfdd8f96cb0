// What the paged attention kernels share (attention.cpp for the model's storage type, kv_int8.cpp for
// the int8 KV cache): the split of (row, KV head) tasks between threads, a row's sliding window,
// the soft cap and the softmax over a task's scores.
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include "common.h"

namespace pl {

inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// Each of the `rows` runs of `len` scores becomes its softmax, in place.
inline void softmax_rows(float* scores, int64_t rows, int64_t len) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * len;
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
    const V inv = vset1(1.f / vsum(vtotal));
    for (t = 0; t + kLanes <= len; t += kLanes) vstore(s + t, vmul(vload(s + t), inv));
    if (t < len) vstore_n(s + t, vmul(vload_n(s + t, static_cast<int>(len - t)), inv), static_cast<int>(len - t));
  }
}

// Splits the (row, KV head) tasks into one contiguous range per thread with about equal total
// context length, and runs fn(begin, end) on each.
template <typename Fn>
void parallel_by_length(const int32_t* lens, int64_t nkv, int64_t items, int threads, const Fn& fn) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, items));
  std::vector<int64_t> cum(items + 1, 0);  // cost of a task: its context length + a fixed overhead
  for (int64_t i = 0; i < items; ++i) cum[i + 1] = cum[i] + lens[i / nkv] + 16;
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

// Shapes of one call, shared by every path.
struct Shape {
  int64_t nh, nkv, D, bs, maxb, q_stride, group, block_stride;
  float scale;
  float softcap = 0.f;  // Gemma 2's attention logit soft cap (0: none)
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
