// Paged attention for decode tokens (one query per sequence), reading K/V in place from the
// block-structured cache: no gathered copy of the context, no padding to the longest sequence.
//
// Work items are (sequence, KV head) pairs, spread over torch's intra-op threads with
// at::parallel_for (built with -fopenmp, the extension shares torch's libgomp.so.1 runtime).
// The query heads sharing a KV head are handled together so each K/V row is read once.
// Scores are float32: one pass over K, a softmax, one pass over V.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {
inline void load_row(const float* __restrict__ src, float* __restrict__ dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* __restrict__ bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* __restrict__ wide = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) wide[d] = static_cast<uint32_t>(bits[d]) << 16;
}
inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, at::BFloat16* dst, int64_t n) { for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<at::BFloat16>(src[d]); }

template <int kDim, typename T>
void decode_range(const T* q, const T* kc, const T* vc, const int32_t* tables, const int32_t* lens, T* out,
                  int64_t begin, int64_t end, int64_t nh, int64_t nkv, int64_t bs, int64_t maxb, float scale,
                  int64_t head_dim) {
  const int64_t D = kDim > 0 ? kDim : head_dim;  // compile-time head_dim for the common sizes: unrolled loops
  const int64_t group = nh / nkv, block_stride = nkv * bs * D;  // cache: (blocks, kv_heads, bs, D)
  std::vector<float> qf(group * D), acc(group * D), scores, kbuf(bs * D);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t seq = task / nkv, h = task % nkv, len = lens[seq];
    const int32_t* table = tables + seq * maxb;
    for (int64_t g = 0; g < group; ++g) {
      load_row(q + (seq * nh + h * group + g) * D, qf.data() + g * D, D);
      for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= scale;
    }
    scores.resize(group * len);
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
      const int64_t n = std::min<int64_t>(bs, len - t0);
      const T* base = kc + static_cast<int64_t>(table[t0 / bs]) * block_stride + h * bs * D;
      load_row(base, kbuf.data(), n * D);  // this head's slots of the block are one contiguous run
      for (int64_t g = 0; g < group; ++g) {
        const float* __restrict__ qg = qf.data() + g * D;
        for (int64_t o = 0; o < n; ++o) {
          const float* __restrict__ k = kbuf.data() + o * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
          scores[g * len + t0 + o] = s;
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores.data() + g * len;
      const float top = *std::max_element(sg, sg + len);
      float total = 0.f;
#pragma omp simd reduction(+ : total)
      for (int64_t t = 0; t < len; ++t) {  // vectorised exp (libmvec) with -ffast-math
        sg[t] = std::exp(sg[t] - top);
        total += sg[t];
      }
      const float inv = 1.f / total;
#pragma omp simd
      for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
      const int64_t n = std::min<int64_t>(bs, len - t0);
      const T* base = vc + static_cast<int64_t>(table[t0 / bs]) * block_stride + h * bs * D;
      load_row(base, kbuf.data(), n * D);
      for (int64_t g = 0; g < group; ++g) {
        float* __restrict__ ag = acc.data() + g * D;
        for (int64_t o = 0; o < n; ++o) {
          const float p = scores[g * len + t0 + o];
          const float* __restrict__ v = kbuf.data() + o * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) store_row(acc.data() + g * D, out + (seq * nh + h * group + g) * D, D);
  }
}
template <typename T>
void dispatch(torch::Tensor& q, torch::Tensor& kc, torch::Tensor& vc, torch::Tensor& tables, torch::Tensor& lens,
              torch::Tensor& out, float scale) {
  const int64_t nh = q.size(1), D = q.size(2), nkv = kc.size(1), bs = kc.size(2), maxb = tables.size(1);
  const int64_t items = q.size(0) * nkv;
  auto run = [&](auto dim) {
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      decode_range<decltype(dim)::value>(q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(),
                                         tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<T>(),
                                         begin, end, nh, nkv, bs, maxb, scale, D);
    });
  };
  switch (D) {
    case 64: run(std::integral_constant<int, 64>{}); break;
    case 128: run(std::integral_constant<int, 128>{}); break;
    default: run(std::integral_constant<int, 0>{});
  }
}

}  // namespace

// q: (num_seqs, num_heads, head_dim); key/value cache: (num_blocks, kv_heads, block_size, head_dim);
// tables: (num_seqs, max_blocks) int32; lens: (num_seqs,) int32; out like q (filled).
void paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables, torch::Tensor lens,
                  torch::Tensor out, double scale) {
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous() && out.is_contiguous());
  TORCH_CHECK(tables.scalar_type() == torch::kInt32 && lens.scalar_type() == torch::kInt32);
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous() && q.size(1) % kc.size(1) == 0);
  TORCH_CHECK(q.scalar_type() == kc.scalar_type() && q.scalar_type() == vc.scalar_type());
  pybind11::gil_scoped_release nogil;
  if (q.scalar_type() == torch::kBFloat16) {
    dispatch<at::BFloat16>(q, kc, vc, tables, lens, out, static_cast<float>(scale));
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kFloat32, "paged_decode supports float32 and bfloat16");
    dispatch<float>(q, kc, vc, tables, lens, out, static_cast<float>(scale));
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged attention for a batch of one-query sequences");
}
