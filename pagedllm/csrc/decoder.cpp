// A Llama-family decoder stack in one call: every layer's RMSNorm, QKV GEMM, rotary, K/V write,
// paged attention, O GEMM, RMSNorm, gate_up GEMM with SiLU and down GEMM, then the final norm,
// for the step's flat batch of rows. The same kernels the layers call one by one from Python
// (models/cpu_stack.py builds the plan of pointers once); one call per step instead of ~10 per
// layer. A one-sequence decode step of SmolLM2-135M spent ~5 ms of ~17 ms in Python between
// the kernels; this is what removes it. Results equal the layer-by-layer path bit for bit: same
// kernels, same roundings (a row-parallel bias is added after the GEMM's rounding, as there).
#include <vector>
#include "common.h"

PL_EXPORT int pl_gemm(const void* x, int64_t lda, const void* packed, const float* bias, void* out, int64_t ldc,
                      int64_t M, int64_t N, int64_t K, int dtype, int silu, int threads);
PL_EXPORT int pl_qgemm(const void* x, int64_t lda, const void* w, int packed, void* out, int64_t ldc, int64_t M,
                       int64_t N, int64_t K, int qtype, int dtype, int threads);
PL_EXPORT int pl_amx_gemm(const void* x, int64_t lda, const void* w, void* out, int64_t ldc, int64_t M, int64_t N,
                          int64_t K, int threads);
PL_EXPORT int pl_silu_and_mul(const void* x, int64_t xs, void* out, int64_t os, int64_t rows, int64_t D, int dtype,
                              int threads);
PL_EXPORT int pl_rms_norm(const void* x, int64_t xs, void* residual, int64_t rs, const void* weight, void* out,
                          int64_t os, int64_t rows, int64_t H, float eps, int dtype, int threads);
PL_EXPORT int pl_rotary(const int64_t* positions, void* qkv, int64_t stride, const void* cos, const void* sin,
                        int64_t rows, int64_t heads, int64_t D, int64_t max_pos, int dtype, int threads);
PL_EXPORT int pl_write_kv(const void* k, int64_t ks, int64_t khs, const void* v, int64_t vs, int64_t vhs, void* kc,
                          void* vc, const int64_t* slots, int64_t tokens, int64_t nkv, int64_t bs, int64_t D,
                          int64_t blocks, int64_t esize, int threads);
PL_EXPORT int pl_paged_attention_window(const void* q, int64_t q_stride, const void* kc, const void* vc,
                                        const int32_t* tables, int64_t maxb, const int32_t* lens, const int32_t* starts,
                                        void* out, int64_t rows, int64_t nh, int64_t nkv, int64_t bs, int64_t D,
                                        float scale, float softcap, int dtype, int threads, int split);
PL_EXPORT int pl_write_kv_i8(const void* k, int64_t ks, int64_t khs, const void* v, int64_t vs, int64_t vhs, void* kc,
                             void* vc, const int64_t* slots, int64_t tokens, int64_t nkv, int64_t bs, int64_t D,
                             int64_t blocks, int dtype, int threads);
PL_EXPORT int pl_paged_attention_i8(const void* q, int64_t q_stride, const void* kc, const void* vc,
                                    const int32_t* tables, int64_t maxb, const int32_t* lens, const int32_t* starts,
                                    void* out, int64_t rows, int64_t nh, int64_t nkv, int64_t bs, int64_t D,
                                    float scale, float softcap, int dtype, int threads, int split);

// One layer's weights: GEMM weights packed by pl_gemm_pack (gate_up in the fused-SiLU order),
// column-parallel biases as float32 (added inside the GEMM), row-parallel ones in the storage
// type (added after it), null where there is none. A weight whose qtype is not 0 is a GGUF format
// packed by pl_qpack (quant.cpp; gate_up then [gate; up], SiLU-and-mul a separate pass), its bias
// in the storage type, added after the GEMM as the layers do. qtype kAmxPlain: the plain bf16 weight for the AMX
// GEMM (gemm_amx.cpp; the "amx" level, steps of up to 32 rows), handled like a quantized one (bias in the storage
// type, gate_up then SiLU-and-mul). A quantized qkv may come in two segments of
// rows (llama.cpp's Q4_K_M gives some layers' v a format of its own): qkv2 holds rows qkv2_offset on.
struct LayerPlan {
  const void* input_norm;
  const void* post_norm;
  const void* qkv;
  const float* qkv_bias;
  const void* o;
  const void* o_bias;
  const void* gate_up;
  const float* gate_up_bias;
  const void* down;
  const void* down_bias;
  void* k_cache;
  void* v_cache;
  int qkv_qtype, o_qtype, gate_up_qtype, down_qtype;
  const void* qkv2;  // null: qkv is one segment
  int64_t qkv2_offset;
  int qkv2_qtype;
};

struct StackPlan {
  int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, block_size, num_blocks, max_pos;
  float eps, scale;
  int dtype;
  int kv_int8;          // the KV caches are int8 (kv_int8.cpp's layout), else in the storage type
  int attention_flags;  // or-ed into the paged attention's split mode (attention.h: kAmxTiles at the "amx" level)
  const void* cos;
  const void* sin;
  const void* final_norm;
  const LayerPlan* layer;
};

namespace {
using namespace pl;

constexpr int kAmxPlain = -1;  // a LayerPlan qtype: the plain bf16 weight on AMX tiles

// out (M, N; row stride ldc) = x W^T (+ float32 bias, our GEMM only) by our GEMM, the AMX one or the quantized one
int linear(const void* x, int64_t lda, const void* w, int qtype, const float* bias, void* out, int64_t ldc, int64_t M,
           int64_t N, int64_t K, int dt, int threads) {
  if (qtype == kAmxPlain) return pl_amx_gemm(x, lda, w, out, ldc, M, N, K, threads);
  if (qtype) return pl_qgemm(x, lda, w, 1, out, ldc, M, N, K, qtype, dt, threads);
  return pl_gemm(x, lda, w, bias, out, ldc, M, N, K, dt, 0, threads);
}

// out[r] = T(out[r] + bias), as torch's `out + bias` after the GEMM's own rounding
template <typename T>
void add_bias(T* out, const T* bias, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = from_f32<T>(to_f32(out[r * cols + c]) + to_f32(bias[c]));
}

template <typename T>
int run(const StackPlan& p, int64_t M, T* hidden, T* residual, T* work, const int64_t* positions, const int64_t* slots,
        const int32_t* tables, int64_t maxb, const int32_t* lens, int threads) {
  const int64_t H = p.hidden, D = p.head_dim, nh = p.heads, nkv = p.kv_heads, I = p.intermediate;
  const int64_t qkv_cols = (nh + 2 * nkv) * D, esize = sizeof(T);
  T* qkv = work;                 // (M, qkv_cols)
  T* attn = qkv + M * qkv_cols;  // (M, nh * D)
  T* mlp = attn + M * nh * D;    // (M, I)
  T* gate_up = mlp + M * I;      // (M, 2 I): only for a quantized gate_up (no fused SiLU)
  const int dt = p.dtype;
  for (int64_t l = 0; l < p.layers; ++l) {
    const LayerPlan& w = p.layer[l];
    int rc;
    if (l == 0) {  // residual <- the embeddings, hidden <- norm(them)
      std::memcpy(residual, hidden, M * H * esize);
      rc = pl_rms_norm(residual, H, nullptr, 0, w.input_norm, hidden, H, M, H, p.eps, dt, threads);
    } else {
      rc = pl_rms_norm(hidden, H, residual, H, w.input_norm, hidden, H, M, H, p.eps, dt, threads);
    }
    const int64_t qkv_first = w.qkv2 ? w.qkv2_offset : qkv_cols;  // rows of the first segment
    if (rc || (rc = linear(hidden, H, w.qkv, w.qkv_qtype, w.qkv_bias, qkv, qkv_cols, M, qkv_first, H, dt, threads)) ||
        (w.qkv2 && (rc = pl_qgemm(hidden, H, w.qkv2, 1, qkv + qkv_first, qkv_cols, M, qkv_cols - qkv_first, H,
                                  w.qkv2_qtype, dt, threads))))
      return rc;
    if (w.qkv_qtype && w.qkv_bias) add_bias(qkv, reinterpret_cast<const T*>(w.qkv_bias), M, qkv_cols);
    if ((rc = pl_rotary(positions, qkv, qkv_cols, p.cos, p.sin, M, nh + nkv, D, p.max_pos, dt, threads))) return rc;
    const T* k = qkv + nh * D;
    const T* v = k + nkv * D;
    if (p.kv_int8) {
      if ((rc = pl_write_kv_i8(k, qkv_cols, D, v, qkv_cols, D, w.k_cache, w.v_cache, slots, M, nkv, p.block_size, D,
                               p.num_blocks, dt, threads)) ||
          (rc = pl_paged_attention_i8(qkv, qkv_cols, w.k_cache, w.v_cache, tables, maxb, lens, nullptr, attn, M, nh,
                                      nkv, p.block_size, D, p.scale, 0.f, dt, threads,
                                      p.attention_flags)))  // split: automatic
        return rc;
    } else if ((rc = pl_write_kv(k, qkv_cols, D, v, qkv_cols, D, w.k_cache, w.v_cache, slots, M, nkv, p.block_size, D,
                                 p.num_blocks, esize, threads)) ||
               (rc = pl_paged_attention_window(qkv, qkv_cols, w.k_cache, w.v_cache, tables, maxb, lens, nullptr, attn,
                                               M, nh, nkv, p.block_size, D, p.scale, 0.f, dt, threads,
                                               p.attention_flags))) {  // split: automatic
      return rc;
    }
    if ((rc = linear(attn, nh * D, w.o, w.o_qtype, nullptr, hidden, H, M, H, nh * D, dt, threads))) return rc;
    if (w.o_bias) add_bias(hidden, static_cast<const T*>(w.o_bias), M, H);
    if ((rc = pl_rms_norm(hidden, H, residual, H, w.post_norm, hidden, H, M, H, p.eps, dt, threads))) return rc;
    if (w.gate_up_qtype) {
      if ((rc = linear(hidden, H, w.gate_up, w.gate_up_qtype, nullptr, gate_up, 2 * I, M, 2 * I, H, dt, threads)))
        return rc;
      if (w.gate_up_bias) add_bias(gate_up, reinterpret_cast<const T*>(w.gate_up_bias), M, 2 * I);
      if ((rc = pl_silu_and_mul(gate_up, 2 * I, mlp, I, M, I, dt, threads))) return rc;
    } else if ((rc = pl_gemm(hidden, H, w.gate_up, w.gate_up_bias, mlp, I, M, 2 * I, H, dt, 1, threads))) {
      return rc;
    }
    if ((rc = linear(mlp, I, w.down, w.down_qtype, nullptr, hidden, H, M, H, I, dt, threads))) return rc;
    if (w.down_bias) add_bias(hidden, static_cast<const T*>(w.down_bias), M, H);
  }
  return pl_rms_norm(hidden, H, residual, H, p.final_norm, hidden, H, M, H, p.eps, dt, threads);
}
}  // namespace

// Runs the whole stack on M rows. hidden (M, H): the embeddings in, the final norm's output out;
// residual (M, H) and work (M, (heads + 2 kv_heads) * D + heads * D + intermediate, + 2 intermediate with a
// quantized gate_up) are scratch.
// positions, slots (M,) int64; tables (M, maxb) and lens (M,) int32 as for pl_paged_attention.
PL_EXPORT int pl_llama_stack(const StackPlan* plan, int64_t M, void* hidden, void* residual, void* work,
                             const int64_t* positions, const int64_t* slots, const int32_t* tables, int64_t maxb,
                             const int32_t* lens, int threads) {
  return with_dtype(plan->dtype, [&](auto t) {
    using T = decltype(t);
    return run<T>(*plan, M, static_cast<T*>(hidden), static_cast<T*>(residual), static_cast<T*>(work), positions, slots,
                  tables, maxb, lens, threads);
  });
}
