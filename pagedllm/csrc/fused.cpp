// Fused element-wise ops of a decoder layer: residual add + RMSNorm, rotary embedding (in place,
// neox layout), SiLU-and-mul, and the sampler's inverse-CDF draw; and an encoder's residual add + LayerNorm. Each
// replaces 4-8 torch ops that each read and write the whole activation; here every element is read once, written once.
//
// float, bf16 and f16 storage, float32 arithmetic. The rounding follows the torch expressions in
// layers/norm.py, rotary.py and activation.py op by op (every intermediate torch stores as T is
// rounded to T here too), and RMSNorm sums its squares in torch's own float32 order, so results
// match torch's up to the last bit of exp(). Rows are spread over the threads; small batches stay
// on the calling thread. Built with -ffp-contract=off: a product torch rounds stays rounded.
#include <limits>
#include <vector>
#include "common.h"

namespace {
using namespace pl;

// Rows per task so that a task holds at least ~16k elements: below that, threads cost more than they save.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

// sum(x^2) over a row, added in the order torch's CPU sum kernel uses for a contiguous float32 row
// (8-lane vectors, 4 interleaved accumulators, cascade levels of 16, the lanes added last), so the
// norm rounds exactly as transformers' ``h.pow(2).mean(-1)`` does, bit for bit.
template <typename T>
float sum_squares_torch_order(const T* x, int64_t n) {
  auto sq8 = [x](int64_t v) {
    const __m256 h = load8(x + 8 * v);
    return _mm256_mul_ps(h, h);  // rounded before the add, as pow(2) then sum
  };
  const int64_t nv = n / 8, size = nv / 4;
  int64_t log2 = 0;
  while ((int64_t(1) << log2) < size) ++log2;
  const int64_t power = std::max<int64_t>(4, log2 / 4), step = int64_t(1) << power, mask = step - 1;
  __m256 acc[4][4];
  for (auto& level : acc)
    for (auto& a : level) a = _mm256_setzero_ps();
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
    const float h = to_f32(x[d]);
    total += h * h;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc[0][0]);
  for (float lane : lanes) total += lane;
  return total;
}

// Applies fn(offset, count) over [0, n) in vectors, the last one partial.
template <typename Fn>
inline void for_vectors(int64_t n, const Fn& fn) {
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) fn(d, kLanes);
  if (d < n) fn(d, static_cast<int>(n - d));
}
template <typename T>
inline V load_any(const T* p, int n) {
  return n == kLanes ? vload(p) : vload_n(p, n);
}
template <typename T>
inline void store_any(T* p, V v, int n) {
  if (n == kLanes) vstore(p, v);
  else vstore_n(p, v, n);
}

template <typename T>
void rms_norm(const T* x, int64_t xs, T* res, int64_t rs, const T* w, T* out, int64_t os, int64_t rows, int64_t H,
              float eps, int threads) {
  parallel_for(rows, threads, grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* xr = x + i * xs;
      T* rr = res ? res + i * rs : nullptr;
      if (rr)  // the residual sum, rounded to T as torch's x + residual
        for_vectors(H, [&](int64_t d, int n) { store_any(rr + d, vadd(load_any(xr + d, n), load_any(rr + d, n)), n); });
      const T* src = rr ? rr : xr;
      const V inv = vset1(1.f / std::sqrt(sum_squares_torch_order(src, H) / static_cast<float>(H) + eps));
      T* orow = out + i * os;
      for_vectors(H, [&](int64_t d, int n) {  // scale, round as torch's .to(T), times the weight
        store_any(orow + d, vmul(vround_as<T>(vmul(load_any(src + d, n), inv)), load_any(w + d, n)), n);
      });
    }
  });
}

// LayerNorm(x + res) (res may be null): the sum rounded to T as torch's x + res, then mean and (biased)
// variance in float32, (h - mean) / sqrt(var + eps) * w + b rounded to T. One read of each input, one write.
template <typename T>
void layer_norm(const T* x, int64_t xs, const T* res, int64_t rs, const T* w, const T* b, T* out, int64_t os,
                int64_t rows, int64_t H, float eps, int threads) {
  parallel_for(rows, threads, grain(H), [&](int64_t begin, int64_t end) {
    std::vector<float> h(H);
    for (int64_t i = begin; i < end; ++i) {
      const T* xr = x + i * xs;
      const T* rr = res ? res + i * rs : nullptr;
      V total = vzero();
      for_vectors(H, [&](int64_t d, int n) {  // lanes past n load as 0
        V v = load_any(xr + d, n);
        if (rr) v = vround_as<T>(vadd(v, load_any(rr + d, n)));
        store_any(h.data() + d, v, n);
        total = vadd(total, v);
      });
      const float mean = vsum(total) / static_cast<float>(H);
      const V vmean = vset1(mean);
      V sq = vzero();
      for_vectors(H, [&](int64_t d, int n) {
        const V c = vkeep_range(vsub(load_any(h.data() + d, n), vmean), 0, n, 0.f);
        sq = vfma(c, c, sq);
      });
      const V rstd = vset1(1.f / std::sqrt(vsum(sq) / static_cast<float>(H) + eps));
      T* orow = out + i * os;
      for_vectors(H, [&](int64_t d, int n) {
        const V c = vmul(vsub(load_any(h.data() + d, n), vmean), rstd);
        store_any(orow + d, vfma(c, load_any(w + d, n), load_any(b + d, n)), n);
      });
    }
  });
}

template <typename T>
void rotary(const int64_t* pos, T* qkv, int64_t stride, const T* cos, const T* sin, int64_t rows, int64_t heads,
            int64_t D, int threads) {
  const int64_t half = D / 2;
  parallel_for(rows, threads, grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* c = cos + pos[i] * D;
      const T* s = sin + pos[i] * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qkv + i * stride + h * D;
        for_vectors(half, [&](int64_t d, int n) {
          const V x1 = load_any(x + d, n), x2 = load_any(x + half + d, n);
          const V cv = load_any(c + d, n), sv = load_any(s + d, n);
          // each product and the sum rounded to T, as q * cos + rotate_half(q) * sin is in torch
          const V o1 = vsub(vround_as<T>(vmul(x1, cv)), vround_as<T>(vmul(x2, sv)));
          const V o2 = vadd(vround_as<T>(vmul(x2, cv)), vround_as<T>(vmul(x1, sv)));
          store_any(x + d, o1, n);
          store_any(x + half + d, o2, n);
        });
      }
    }
  });
}

template <typename T>
void silu_and_mul(const T* x, int64_t xs, T* out, int64_t os, int64_t rows, int64_t d, int threads) {
  parallel_for(rows, threads, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* g = x + i * xs;
      const T* u = g + d;
      T* o = out + i * os;
      for_vectors(d, [&](int64_t j, int n) {
        store_any(o + j, vmul(vround_as<T>(vsilu(load_any(g + j, n))), load_any(u + j, n)), n);
      });
    }
  });
}

// One draw per row of logits (rows, vocab) by inverse CDF, as layers/sampler.py's torch path:
// x = logits / temperature (when given), w = exp(x - max x), chunk sums of 256 tokens pick the
// chunk where the running sum reaches u * total, then the running sum inside that chunk picks the
// token. Three reads of a row (max, chunk sums, one chunk) instead of torch's div, max, sub, exp,
// sum, cumsum and gather over the whole (rows, vocab) array.
template <typename T>
void sample_rows(const T* logits, int64_t ls, const float* temperature, const float* u, int64_t* out, int64_t rows,
                 int64_t vocab, int threads) {
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  parallel_for(rows, threads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cum(chunks);
    for (int64_t i = begin; i < end; ++i) {
      const T* x = logits + i * ls;
      const V t = vset1(temperature ? temperature[i] : 1.f);
      auto scaled = [&](int64_t j, int n) {  // lanes past the end read -inf: weight 0
        const V v = n == kLanes ? vload(x + j) : vload_n(x + j, n, -INFINITY);
        return temperature ? vdiv(v, t) : v;
      };
      V vmx = vset1(-INFINITY);
      for_vectors(vocab, [&](int64_t j, int n) { vmx = vmax(vmx, scaled(j, n)); });
      const V top = vset1(vmaxval(vmx));
      // exp() of anything below -104 is 0 in float32; the floor keeps -inf - (-inf) from making NaN
      auto weight = [&](int64_t j, int n) { return vexp(vmax(vsub(scaled(j, n), top), vset1(-104.f))); };
      float running = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        V acc = vzero();
        const int64_t lo = c * kChunk, hi = std::min(vocab, lo + kChunk);
        for_vectors(hi - lo, [&](int64_t j, int n) { acc = vadd(acc, weight(lo + j, n)); });
        running += vsum(acc);
        cum[c] = running;
      }
      const float target = u[i] * running;
      const int64_t c = std::min<int64_t>(std::lower_bound(cum.begin(), cum.end(), target) - cum.begin(), chunks - 1);
      const float before = c > 0 ? cum[c - 1] : 0.f;
      const int64_t lo = c * kChunk, hi = std::min(vocab, lo + kChunk);
      alignas(64) float w[kChunk + kLanes];
      for_vectors(hi - lo, [&](int64_t j, int n) { vstore(w + j, weight(lo + j, n)); });
      float inner_total = 0.f;
      for (int64_t j = 0; j < hi - lo; ++j) inner_total += w[j];
      const float inner_target = std::min(std::max(target - before, std::numeric_limits<float>::min()), inner_total);
      float inner = 0.f;
      int64_t pick = hi - lo - 1;
      for (int64_t j = 0; j < hi - lo; ++j) {
        inner += w[j];
        if (inner >= inner_target) {
          pick = j;
          break;
        }
      }
      out[i] = lo + pick;
    }
  });
}
// The index of each row's largest logit (the first one where several are equal, as torch.argmax).
template <typename T>
void argmax_rows(const T* logits, int64_t ls, int64_t* out, int64_t rows, int64_t vocab, int threads) {
  parallel_for(rows, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* x = logits + i * ls;
      V vmx = vset1(-INFINITY);
      for_vectors(vocab, [&](int64_t j, int n) {
        const V v = n == kLanes ? vload(x + j) : vload_n(x + j, n, -INFINITY);
        vmx = vmax(vmx, v);
      });
      const float top = vmaxval(vmx);
      int64_t pick = 0;
      while (pick < vocab - 1 && to_f32(x[pick]) != top) ++pick;
      out[i] = pick;
    }
  });
}
}  // namespace

// Without residual: out = weight * T(x * rsqrt(mean(x^2) + eps)). With residual: residual <-
// T(x + residual), then out = norm(residual). out may alias x. Strides are in elements.
PL_EXPORT int pl_rms_norm(const void* x, int64_t xs, void* residual, int64_t rs, const void* weight, void* out,
                          int64_t os, int64_t rows, int64_t H, float eps, int dtype, int threads) {
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    rms_norm<T>(static_cast<const T*>(x), xs, static_cast<T*>(residual), rs, static_cast<const T*>(weight),
                static_cast<T*>(out), os, rows, H, eps, threads);
    return 0;
  });
}

// LayerNorm(x + residual) into out (residual may be null; row strides xs, rs, os), weight and bias (H,).
PL_EXPORT int pl_layer_norm(const void* x, int64_t xs, const void* residual, int64_t rs, const void* weight,
                            const void* bias, void* out, int64_t os, int64_t rows, int64_t H, float eps, int dtype,
                            int threads) {
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    layer_norm<T>(static_cast<const T*>(x), xs, static_cast<const T*>(residual), rs, static_cast<const T*>(weight),
                  static_cast<const T*>(bias), static_cast<T*>(out), os, rows, H, eps, threads);
    return 0;
  });
}

// In place on qkv (rows, >= heads * D; row stride `stride`): the first `heads` heads of each row
// are rotated (neox: halves x1, x2 -> x1 cos - x2 sin, x2 cos + x1 sin) at the row's position,
// with cos/sin (max_pos, D) tables whose two halves are equal.
PL_EXPORT int pl_rotary(const int64_t* positions, void* qkv, int64_t stride, const void* cos, const void* sin,
                        int64_t rows, int64_t heads, int64_t D, int64_t max_pos, int dtype, int threads) {
  for (int64_t i = 0; i < rows; ++i)  // checked up front: nothing is written when one is bad
    if (positions[i] < 0 || positions[i] >= max_pos) {
      set_error("position %lld is outside the rotary table (%lld positions)", static_cast<long long>(positions[i]),
                static_cast<long long>(max_pos));
      return -1;
    }
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    rotary<T>(positions, static_cast<T*>(qkv), stride, static_cast<const T*>(cos), static_cast<const T*>(sin), rows,
              heads, D, threads);
    return 0;
  });
}

// x (rows, 2d) packed [gate, up] -> out (rows, d) = T(silu(gate)) * up.
PL_EXPORT int pl_silu_and_mul(const void* x, int64_t xs, void* out, int64_t os, int64_t rows, int64_t d, int dtype,
                              int threads) {
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    silu_and_mul<T>(static_cast<const T*>(x), xs, static_cast<T*>(out), os, rows, d, threads);
    return 0;
  });
}

// out[i] = the token drawn for row i of logits (rows, vocab; row stride ls) with uniform u[i] in
// (0, 1], at temperature[i] (null: 1).
PL_EXPORT int pl_sample(const void* logits, int64_t ls, const float* temperature, const float* u, int64_t* out,
                        int64_t rows, int64_t vocab, int dtype, int threads) {
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    sample_rows<T>(static_cast<const T*>(logits), ls, temperature, u, out, rows, vocab, threads);
    return 0;
  });
}

// out[i] = argmax of row i of logits (rows, vocab; row stride ls).
PL_EXPORT int pl_argmax(const void* logits, int64_t ls, int64_t* out, int64_t rows, int64_t vocab, int dtype,
                        int threads) {
  return with_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    argmax_rows<T>(static_cast<const T*>(logits), ls, out, rows, vocab, threads);
    return 0;
  });
}
