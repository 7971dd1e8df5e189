// The CUDA backend's kernels as plain host functions over device pointers, shared by the .cu files
// that define them and the host code (backend.cc, matmul.cc) that calls them. Each queues its
// work on the compute stream (runtime.h) and checks the launch; arguments are validated by the
// callers. Nothing here uses atomics on floats: every reduction runs in a fixed order, so repeated
// calls give identical bits (tetra promises bit-identical resumes). bf16 values are their bits
// (uint16_t) so this header needs no CUDA type.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tetra::cuda::launch {

// ---- memory and matmul helpers (elementwise.cu) -------------------------------------------------
/** dst (rows, cols) with row stride dst_stride = src (rows, cols) with row stride src_stride. */
void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
               int64_t cols);

/** Element types of gather(). */
enum class Elem : uint8_t { f32, bf16 };
/** A (b0, b1, rows, cols) operand with element strides `s` copied into dense `dst`, converted
 *  between f32 and bf16 (rounded to nearest even, as round_bf16). Dense is row-major, or with
 *  `col_major` column-major per matrix: dst[((i0 * b1 + i1) * cols + c) * rows + r]. */
void gather(void* dst, Elem dst_type, const void* src, Elem src_type, const int64_t s[4],
            int64_t b0, int64_t b1, int64_t rows, int64_t cols, bool col_major);
/** The inverse for f32: dense row-major src (b0, b1, rows, cols) into dst with strides `s`. */
void scatter(float* dst, const int64_t s[4], const float* src, int64_t b0, int64_t b1, int64_t rows,
             int64_t cols);
/** c (M, N) with row stride ldc += bias (N) on every row. */
void add_bias_rows(float* c, int64_t ldc, const float* bias, int64_t M, int64_t N);

// ---- element-wise (elementwise.cu)
// ---------------------------------------------------------------
/** SwiGLU: out (n) = silu(gate) * up. */
void swiglu_forward(float* out, const float* gate, const float* up, int64_t n);
/** dgate, dup (n) overwritten from dout (n); dgate may alias dout. */
void swiglu_backward(float* dgate, float* dup, const float* dout, const float* gate,
                     const float* up, int64_t n);
void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);
void bias_gelu_forward(float* out, float* fch, const float* bias, int64_t N, int OC);
void gelu_bias_backward(float* dinp, float* dbias, const float* inp, const float* dout, int64_t N,
                        int OC);
void bias_backward(float* dbias, const float* dout, int64_t N, int OC);
void residual_bias_add(float* out, const float* residual, const float* bias, int64_t N, int C);
void add(float* y, const float* x, int64_t n);
void add_positions(float* out, const float* wpe, int64_t first_row, int64_t rows, int T, int C);
void to_bf16(uint16_t* dst, const float* src, int64_t n);
void from_bf16(float* dst, const uint16_t* src, int64_t n, float scale);

// ---- mixture of experts (moe_rows.cu)
// ------------------------------------------------------------
void gather_rows(float* out, const float* in, const int32_t* idx, int64_t rows, int C);
void moe_combine(float* out, const float* in, const int32_t* pos, const float* gate, int64_t N,
                 int k, int C);
void moe_combine_backward(float* din, float* dgate, const float* dout, const float* in,
                          const int32_t* pos, const float* gate, int64_t N, int k, int C);

// ---- embedding (embedding.cu)
// --------------------------------------------------------------------
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int B,
                       int T, int C, int pos0, int v0, int Vl);
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int B,
                        int T, int C, int v0, int Vl);

// ---- LayerNorm (layernorm.cu)
// ---------------------------------------------------------------------
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int C);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean, const float* rstd,
                        int64_t N, int C);

// ---- RMSNorm (rmsnorm.cu)
// -----------------------------------------------------------------------
/** out (N,C) = inp * rstd * weight, rstd (N) = 1/sqrt(mean(inp²) + eps) saved for backward. */
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int C, double eps);
/** dinp (N,C) and dweight (C) accumulate; dweight's column sums in a fixed order. */
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int C);

// ---- rotary position embedding (rope.cu)
// ---------------------------------------------------------
/** In place on the NH q heads and KVH k heads of qkv (B,T,C + 2·KVH·hs), hs = C/NH even: pairs
 *  (i, i + hs/2) of position pos0 + t turn by (pos0 + t)·theta^(-2i/hs) (angles, cos and sin in
 *  double, then f32), by the opposite angle with `inverse`. */
void rope(float* qkv, int B, int T, int C, int NH, int KVH, int pos0, double theta, bool inverse);

// ---- attention (attention.cu)
// ---------------------------------------------------------------------
/** The largest head size the flash kernels take. */
inline constexpr int kAttentionMaxHeadSize = 128;
/** Causal flash attention over qkv (B,T,W), W = C + 2·KVH·hs: NH query heads, KVH key/value
 *  heads (KVH divides NH; query head h reads kv head h / (NH/KVH)). out (B,T,C) (skipped when
 *  null) and the scaled row log-sum-exp lse (B,NH,T). `round_bf16` rounds q, k, v and the
 *  probabilities to bf16 before their products (mixed precision), accumulating in f32. */
void attention_forward(float* out, float* lse, const float* qkv, int B, int T, int C, int NH,
                       int KVH, bool round_bf16);
/** dqkv (B,T,W) overwritten; dvec (B,NH,T) is scratch for rowsum(dout * out). Under
 *  `round_bf16` the products q.k^T, dout.v^T and p^T.dout take bf16-rounded operands; dq and dk
 *  come from the f32 softmax gradient and f32 k and q. dk and dv of a kv head sum over its query
 *  heads in a fixed order. */
void attention_backward(float* dqkv, float* dvec, const float* dout, const float* qkv,
                        const float* out, const float* lse, int B, int T, int C, int NH, int KVH,
                        bool round_bf16);
/** Writes the T new keys and values of qkv (B,T,W) into kcache, vcache (B,maxT,KVH·hs) at pos0..,
 *  then out (B,T,C) = each new query's attention over cached positions 0..pos0+t. */
void attention_decode(float* out, const float* qkv, float* kcache, float* vcache, int pos0, int B,
                      int T, int C, int NH, int KVH, int maxT);

// ---- blockwise attention (attention_block.cu) ---------------------------------------------------
/** Rows of a (B, T, ·) activation: element (b, t, j) at p[b·batch + t·row + j] (kernels.h's
 *  Rows, without its header). */
struct RowsIn {
  const float* p;
  int64_t row, batch;
};
struct RowsOut {
  float* p;
  int64_t row, batch;
};
/** Kernels<float>::attention_block_forward: merges the block of Tq queries (NH heads of C/NH <=
 *  kAttentionMaxHeadSize) against Tk keys (KVH heads) into out (B,Tq,C) and lse (B,Tq,NH). */
void attention_block_forward(RowsOut out, RowsOut lse, RowsIn q, RowsIn k, RowsIn v, int B, int Tq,
                             int Tk, int C, int NH, int KVH, bool causal);
/** delta (B,Tq,NH) = per head, dout · out over its channels. */
void attention_block_delta(RowsOut delta, RowsIn dout, RowsIn out, int B, int Tq, int C, int NH);
/** dq (B,Tq,C), dk and dv (B,Tk,KVH·hs) accumulate the block's gradients. */
void attention_block_backward(RowsOut dq, RowsOut dk, RowsOut dv, RowsIn dout, RowsIn delta,
                              RowsIn lse, RowsIn q, RowsIn k, RowsIn v, int B, int Tq, int Tk,
                              int C, int NH, int KVH, bool causal);

// ---- softmax + cross-entropy (loss.cu)
// ------------------------------------------------------------
/** losses (N); logits (N,Vp), first V columns real; with `backward` logits become the gradient. */
void softmax_xent(float* losses, float* logits, const int32_t* targets, int64_t N, int V, int Vp,
                  bool backward, float dloss);
/** Vocabulary-parallel pieces: columns [0, real) of logits (N,Vl) are real. mx (N) = row maxima
 *  (lowest float for a row with no real column). */
void xent_row_max(float* mx, const float* logits, int64_t N, int Vl, int real);
/** sums (N,2) = (sum of exp(x - mx), the target's logit if this rank holds it else 0). */
void xent_row_sums(float* sums, const float* logits, const float* mx, const int32_t* targets,
                   int64_t N, int Vl, int real, int v0);
/** losses (N) from the reduced mx and sums; with `backward` logits become the gradient. */
void xent_finish(float* losses, float* logits, const float* mx, const float* sums,
                 const int32_t* targets, int64_t N, int Vl, int real, int v0, bool backward,
                 float dloss);

// ---- reductions and the optimizer (optimizer.cu)
// --------------------------------------------------
/** Sum of x (n) in double, in a fixed order; waits for the result (it returns to the host). */
double sum(const float* x, int64_t n);
/** Per-segment tables of adamw(): seg (nseg, 4) = (param_pos, grad_pos, state_pos, decay) and
 *  starts (nseg + 1) = prefix sums of the segment sizes (starts[nseg] = total elements). */
struct AdamWTables {
  const int64_t* seg = nullptr;
  const int64_t* starts = nullptr;
  int nseg = 0;
  int64_t total = 0;
};
struct AdamWScalars {
  float beta1, beta2, eps, grad_scale, step_size, bc2_sqrt, decayed;
};
/** `rounded` non-null: also the updated parameters' bf16 bits at their params positions. */
void adamw(float* params, const float* grads, float* m, float* v, uint16_t* rounded,
           const AdamWTables& tables, const AdamWScalars& s);
/** Sum of squares in double over ranges (nranges, 2) = (offset, count) of base, summed per range
 *  and then over the ranges in order; `ranges` null means one range (0, max_count). Waits for the
 *  result. */
double sum_squares(const float* base, const int64_t* ranges, int nranges, int64_t max_count);
/** flags (nranges) = 1 where the range holds a NaN or an infinity, else 0. */
void nonfinite_flags(int32_t* flags, const float* base, const int64_t* ranges, int nranges,
                     int64_t max_count);

}  // namespace tetra::cuda::launch
