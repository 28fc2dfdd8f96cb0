// y = x W^T (+ b) for bfloat16 on AVX512-BF16 CPUs, with W packed once after loading.
//
// Packed layout: the output features in blocks of 64 (the last block may be 16, 32 or 48 wide);
// a block of width w is (K/2, w, 2): for each pair of input features, the w outputs' two weights
// side by side, so one 512-bit load holds 16 outputs' pair and vdpbf16ps against the broadcast
// pair of an input row adds two products to 16 float32 sums. A 6-row x 64-column tile keeps 24
// accumulators in registers over the whole K; each sum is rounded to bf16 once at the end.
//
// Work is split into (row chunk, column block) units: chunks of <= 256 rows (the chunk of x
// stays in L2 while the weight blocks stream past), and enough units for every thread.
// Measured on 2 cores (SmolLM2-135M's 30 layers, weights streamed from memory, per step):
// 1 row 6.2 -> 4.2 ms, 16 rows 8.1 -> 6.7, 64 rows 19.5 -> 16.3, 256 rows 56.3 -> 53.6,
// 2048 rows 427 -> 418 against oneDNN's prepacked matmul (layers/prepack.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

#include "simd_bf16.h"

namespace {
constexpr int64_t kBlock = 64;  // output features per packed block (4 registers of 16)
constexpr int kRows = 6;        // rows per register tile: 6 x 4 accumulators + 4 weights + 1 broadcast

// kSilu: the block's first 32 outputs are gate features and the last 32 the matching up
// features (gemm_pack of rows interleaved that way); the tile writes silu(gate) * up, 32 wide,
// each product rounded to bf16 where torch rounds it (matmul output, F.silu, the product).
template <int MR, int NV, bool kSilu>
inline void tile(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t pairs, uint16_t* c, int64_t ldc,
                 const float* bias) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(b + (p * NV + v) * 32);
    for (int r = 0; r < MR; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a + r * lda + 2 * p));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, w[v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v)
      if (bias) acc[r][v] = _mm512_add_ps(acc[r][v], _mm512_loadu_ps(bias + v * 16));
  if constexpr (kSilu) {
    static_assert(NV == 4, "a SiLU block is 32 gate + 32 up features");
    using namespace pagedllm_simd;
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 2; ++v) {  // the GEMM output rounded to bf16 first, as torch stores it
        const __m512 y = _mm512_mul_ps(silu_bf16(round_bf16(acc[r][v])), round_bf16(acc[r][v + 2]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc + v * 16), (__m256i)_mm512_cvtneps_pbh(y));
      }
  } else {
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < NV; ++v)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + r * ldc + v * 16), (__m256i)_mm512_cvtneps_pbh(acc[r][v]));
  }
}

template <int NV, bool kSilu = false>
void rows_of_block(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t pairs, uint16_t* c, int64_t ldc,
                   const float* bias, int64_t rows) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) tile<kRows, NV, kSilu>(a + r * lda, lda, b, pairs, c + r * ldc, ldc, bias);
  a += r * lda;
  c += r * ldc;
  switch (rows - r) {
    case 1: tile<1, NV, kSilu>(a, lda, b, pairs, c, ldc, bias); break;
    case 2: tile<2, NV, kSilu>(a, lda, b, pairs, c, ldc, bias); break;
    case 3: tile<3, NV, kSilu>(a, lda, b, pairs, c, ldc, bias); break;
    case 4: tile<4, NV, kSilu>(a, lda, b, pairs, c, ldc, bias); break;
    case 5: tile<5, NV, kSilu>(a, lda, b, pairs, c, ldc, bias); break;
    default: break;
  }
}
}  // namespace

// (N, K) bf16 weight -> the packed 1-D copy described above. N % 16 == 0, K even.
torch::Tensor gemm_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(), "a contiguous 2-D bf16 weight");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 2 == 0, "packing needs out_features % 16 == 0 and an even in_features");
  auto out = torch::empty({N * K}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, (N + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kBlock, width = std::min(kBlock, N - n0);
      uint16_t* d = dst + n0 * K;  // every earlier block is full: block blk starts at n0 * K
      for (int64_t p = 0; p < K / 2; ++p)
        for (int64_t col = 0; col < width; ++col) {
          d[(p * width + col) * 2] = src[(n0 + col) * K + 2 * p];
          d[(p * width + col) * 2 + 1] = src[(n0 + col) * K + 2 * p + 1];
        }
    }
  });
  return out;
}

// x (M, K) bf16 with unit column stride, packed from gemm_pack of an (N, K) weight, bias (N,) or
// None. With silu_and_mul, the weight's rows were interleaved 32 gate / 32 up per block and the
// result is (M, N / 2) silu(gate) * up.
torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                        bool silu_and_mul) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1, "x: (rows, in) bf16");
  const int64_t M = x.size(0), K = x.size(1), lda = x.stride(0);
  TORCH_CHECK(packed.numel() == N * K && N % 16 == 0 && K % 2 == 0, "packed weight does not match x");
  TORCH_CHECK(!silu_and_mul || N % kBlock == 0, "silu_and_mul needs whole 64-feature blocks");
  const int64_t ldc = silu_and_mul ? N / 2 : N;
  auto out = torch::empty({M, ldc}, x.options());
  if (M == 0) return out;
  torch::Tensor bias_f;
  const float* bp = nullptr;
  if (bias) {
    bias_f = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bias_f.numel() == N);
    bp = bias_f.data_ptr<float>();
  }
  const uint16_t* a = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* b = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  uint16_t* c = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t blocks = (N + kBlock - 1) / kBlock, threads = at::get_num_threads();
  int64_t chunks = (M + 255) / 256;
  while (blocks * chunks < 8 * threads && (M + chunks) / (chunks + 1) >= kRows) ++chunks;  // units for every thread
  const int64_t chunk = ((M + chunks - 1) / chunks + kRows - 1) / kRows * kRows;  // equal chunks of whole tiles
  chunks = (M + chunk - 1) / chunk;
  // units in row-chunk-major order: a thread's consecutive units share its chunk of x
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t m0 = (u / blocks) * chunk, n0 = (u % blocks) * kBlock;
      const int64_t rows = std::min(chunk, M - m0), width = std::min(kBlock, N - n0);
      const uint16_t* ab = a + m0 * lda;
      const uint16_t* bb = b + n0 * K;
      uint16_t* cb = c + m0 * ldc + (silu_and_mul ? n0 / 2 : n0);
      const float* bias_b = bp ? bp + n0 : nullptr;
      if (silu_and_mul) {
        rows_of_block<4, true>(ab, lda, bb, K / 2, cb, ldc, bias_b, rows);
        continue;
      }
      switch (width / 16) {
        case 4: rows_of_block<4>(ab, lda, bb, K / 2, cb, ldc, bias_b, rows); break;
        case 3: rows_of_block<3>(ab, lda, bb, K / 2, cb, ldc, bias_b, rows); break;
        case 2: rows_of_block<2>(ab, lda, bb, K / 2, cb, ldc, bias_b, rows); break;
        default: rows_of_block<1>(ab, lda, bb, K / 2, cb, ldc, bias_b, rows); break;
      }
    }
  });
  return out;
}
