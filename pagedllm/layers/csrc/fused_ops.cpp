// Fused element-wise ops of a decoder layer for bfloat16 on AVX-512 CPUs: residual add + RMSNorm,
// rotary embedding (in place, neox layout) and SiLU-and-mul. Each replaces 4-8 torch ops that
// each read and write the whole activation; here every element is read once and written once.
//
// The rounding follows the torch expressions in layers/norm.py, rotary.py and activation.py op by
// op (every intermediate that torch stores as bfloat16 is rounded to bfloat16 here too), so the
// results match them up to the order of the float32 sum in RMSNorm and the last bit of exp().
// Rows are spread over torch's intra-op threads; small batches stay on the calling thread.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "simd_bf16.h"
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {
using namespace pagedllm_simd;
// Rows per task so that a task holds at least ~16k elements: below that, threads cost more than they save.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

bf16* bits(torch::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kBFloat16, name, " must be a bfloat16 CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}
}  // namespace

// Without residual: out = weight * bf16(x * rsqrt(mean(x^2) + eps)).
// With residual: residual <- bf16(x + residual), then out = norm(residual). out may alias x.
void rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, torch::Tensor out, double eps) {
  check_bf16(x, "x"); check_bf16(weight, "weight"); check_bf16(out, "out");
  const int64_t rows = x.size(0), H = x.size(1);
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && weight.numel() == H && weight.is_contiguous() && H >= 8);
  bf16* res = nullptr;
  int64_t res_stride = 0;
  if (residual) {
    check_bf16(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes());
    res = bits(*residual);
    res_stride = residual->stride(0);
  }
  const bf16* xp = bits(x);
  const bf16* wp = bits(weight);
  bf16* op = bits(out);
  const int64_t xs = x.stride(0), os = out.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bf16* xr = xp + i * xs;
      bf16* rr = res ? res + i * res_stride : nullptr;
      if (rr) {
        for (int64_t d = 0; d < H; d += 16) {  // the residual sum, rounded to bf16 as torch's x + residual
          const __mmask16 m = tail_mask(H - d);
          store_bf16(rr + d, _mm512_add_ps(load_bf16(xr + d, m), load_bf16(rr + d, m)), m);
        }
      }
      const bf16* src = rr ? rr : xr;
      const float inv = 1.f / std::sqrt(sum_squares_torch_order(src, H) / static_cast<float>(H) + feps);
      const __m512 vinv = _mm512_set1_ps(inv);
      bf16* orow = op + i * os;
      for (int64_t d = 0; d < H; d += 16) {  // pass 2: scale, round as torch's .to(bf16), times weight
        const __mmask16 m = tail_mask(H - d);
        const __m512 y = round_bf16(_mm512_mul_ps(load_bf16(src + d, m), vinv));
        store_bf16(orow + d, _mm512_mul_ps(y, load_bf16(wp + d, m)), m);
      }
    }
  });
}

// In place on qkv (tokens, (nh + 2 nkv) * D): the first nh + nkv heads of each row are rotated
// (neox layout: halves x1, x2 -> x1 cos - x2 sin, x2 cos + x1 sin) at the row's position, with
// cos/sin (max_pos, D) bf16 tables whose two halves are equal.
void rotary_inplace(torch::Tensor positions, torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                    int64_t nh, int64_t nkv, int64_t D) {
  check_bf16(qkv, "qkv"); check_bf16(cos, "cos"); check_bf16(sin, "sin");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous());
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) >= (nh + nkv) * D && D % 2 == 0 && cos.is_contiguous() && sin.is_contiguous());
  const int64_t rows = qkv.size(0), half = D / 2, heads = nh + nkv, stride = qkv.stride(0), max_pos = cos.size(0);
  TORCH_CHECK(positions.numel() == rows);
  const int64_t* pos = positions.data_ptr<int64_t>();
  bf16* base = bits(qkv);
  const bf16* cp = bits(cos);
  const bf16* sp = bits(sin);
  at::parallel_for(0, rows, grain(heads * D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = pos[i];
      TORCH_CHECK(p >= 0 && p < max_pos, "position ", p, " is outside the rotary table");
      const bf16* c = cp + p * D;
      const bf16* s = sp + p * D;
      for (int64_t h = 0; h < heads; ++h) {
        bf16* x = base + i * stride + h * D;
        for (int64_t d = 0; d < half; d += 16) {
          const __mmask16 m = tail_mask(half - d);
          const __m512 x1 = load_bf16(x + d, m), x2 = load_bf16(x + half + d, m);
          const __m512 cv = load_bf16(c + d, m), sv = load_bf16(s + d, m);
          // each product and the sum rounded to bf16, as q * cos + rotate_half(q) * sin is in torch
          const __m512 o1 = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, cv)), round_bf16(_mm512_mul_ps(x2, sv)));
          const __m512 o2 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, cv)), round_bf16(_mm512_mul_ps(x1, sv)));
          store_bf16(x + d, o1, m);
          store_bf16(x + half + d, o2, m);
        }
      }
    }
  });
}

// x (tokens, 2d) packed [gate, up] -> out (tokens, d) = bf16(silu(gate)) * up.
void silu_and_mul(torch::Tensor x, torch::Tensor out) {
  check_bf16(x, "x"); check_bf16(out, "out");
  const int64_t rows = x.size(0), d = out.size(1);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(1) == 2 * d && out.size(0) == rows);
  const bf16* xp = bits(x);
  bf16* op = bits(out);
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const bf16* g = xp + i * xs;
      const bf16* u = g + d;
      bf16* o = op + i * os;
      for (int64_t j = 0; j < d; j += 16) {
        const __mmask16 m = tail_mask(d - j);
        store_bf16(o + j, _mm512_mul_ps(silu_bf16(load_bf16(g + j, m)), load_bf16(u + j, m)), m);
      }
    }
  });
}

// One draw per row of float32 logits (rows, V) by inverse CDF, as layers/sampler.py's torch path:
// x = logits / temperature (when given), w = exp(x - max x), chunk sums of 256 tokens pick the
// chunk where the running sum reaches u * total, then the running sum inside that chunk picks the
// token. Three reads of a row (max, chunk sums, one chunk) instead of torch's div, max, sub, exp,
// sum, cumsum and gather over the whole (rows, V) array.
inline __m512 load_logits(const float* p, __mmask16 m) { return _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, p); }
inline __m512 load_logits(const bf16* p, __mmask16 m) {  // masked lanes: -inf, as the float path
  return _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), load_bf16(p, m));
}

template <typename T>
torch::Tensor sample_rows(torch::Tensor logits, c10::optional<torch::Tensor> temperature, torch::Tensor u) {
  TORCH_CHECK(u.scalar_type() == torch::kFloat32 && u.is_contiguous() && u.numel() == logits.size(0));
  const int64_t rows = logits.size(0), V = logits.size(1), ls = logits.stride(0);
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (V + kChunk - 1) / kChunk;
  const float* tp = nullptr;
  torch::Tensor temp;
  if (temperature) {
    temp = temperature->to(torch::kFloat32).contiguous();
    TORCH_CHECK(temp.numel() == rows);
    tp = temp.data_ptr<float>();
  }
  auto out = torch::empty({rows}, torch::kInt64);
  const T* lp = reinterpret_cast<const T*>(logits.data_ptr());
  const float* up = u.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cum(chunks);
    const __m512 floor = _mm512_set1_ps(-104.f);  // exp() of anything lower is 0 in float32; keeps -inf from NaN
    for (int64_t i = begin; i < end; ++i) {
      const T* x = lp + i * ls;
      const __m512 t = _mm512_set1_ps(tp ? tp[i] : 1.f);
      auto scaled = [&](int64_t j, __mmask16 m) {
        const __m512 v = load_logits(x + j, m);
        return tp ? _mm512_div_ps(v, t) : v;
      };
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < V; j += 16) vmax = _mm512_max_ps(vmax, scaled(j, tail_mask(V - j)));
      const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
      auto weight = [&](int64_t j, __mmask16 m) {
        return _mm512_maskz_mov_ps(m, exp_ps(_mm512_max_ps(_mm512_sub_ps(scaled(j, m), top), floor)));
      };
      float running = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        __m512 acc = _mm512_setzero_ps();
        const int64_t hi = std::min(V, (c + 1) * kChunk);
        for (int64_t j = c * kChunk; j < hi; j += 16) acc = _mm512_add_ps(acc, weight(j, tail_mask(hi - j)));
        running += _mm512_reduce_add_ps(acc);
        cum[c] = running;
      }
      const float target = up[i] * running;
      const int64_t c = std::min<int64_t>(std::lower_bound(cum.begin(), cum.end(), target) - cum.begin(), chunks - 1);
      const float before = c > 0 ? cum[c - 1] : 0.f;
      const int64_t lo = c * kChunk, hi = std::min(V, lo + kChunk);
      alignas(64) float w[kChunk];
      for (int64_t j = lo; j < hi; j += 16) _mm512_store_ps(w + (j - lo), weight(j, tail_mask(hi - j)));
      float inner_total = 0.f;
      for (int64_t j = 0; j < hi - lo; ++j) inner_total += w[j];
      const float inner_target = std::min(std::max(target - before, std::numeric_limits<float>::min()), inner_total);
      float inner = 0.f;
      int64_t pick = hi - lo - 1;
      for (int64_t j = 0; j < hi - lo; ++j) {
        inner += w[j];
        if (inner >= inner_target) { pick = j; break; }
      }
      op[i] = lo + pick;
    }
  });
  return out;
}

// logits: (rows, vocab) float32 or bfloat16 (the LM head's own dtype: no float32 copy of the array).
torch::Tensor sample_inverse_cdf(torch::Tensor logits, c10::optional<torch::Tensor> temperature, torch::Tensor u) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be a (rows, vocab) CPU tensor, contiguous in the vocabulary");
  if (logits.scalar_type() == torch::kBFloat16) return sample_rows<bf16>(logits, temperature, u);
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32, "logits must be float32 or bfloat16");
  return sample_rows<float>(logits, temperature, u);
}

// gemm_bf16.cpp, built into the same extension
torch::Tensor gemm_pack(torch::Tensor w);
torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                        bool silu_and_mul);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm_pack", &gemm_pack, "pack an (out, in) bf16 weight for gemm_bf16");
  m.def("gemm_bf16", &gemm_bf16, "x W^T (+ b) with a packed bf16 weight", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "residual add + RMSNorm (bf16)", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rotary_inplace", &rotary_inplace, "neox rotary embedding on q and k in place (bf16)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (bf16)", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("sample_inverse_cdf", &sample_inverse_cdf, "one inverse-CDF draw per row of float32 logits",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
