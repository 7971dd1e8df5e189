// The device seam: one table of every operation the model, the optimizer and the parallel engines
// run on tensor data (Kernels<F>), and the Backend that owns a table per scalar together with the
// Device whose memory the operations read and write (kernels/backend.h). The CPU backend
// (kernels/cpu/) implements it for f32 and f64; the CUDA backend (kernels/cuda/) for f32. Nothing
// outside src/kernels/ names a backend's own functions: code above this layer holds a Backend&
// and calls through its tables, so the same model, ZeRO, tensor-parallel and pipeline code runs on
// whichever backend the run selects (run.device).
//
// Conventions of every operation:
//   - pointers are device memory of the backend's Device (tokens and targets too);
//   - shapes are in the comments, row-major, as in llm.c: "(B,T,C)";
//   - gradients named "accumulates" are added to (+=), so micro-batches accumulate for free;
//     everything else is overwritten;
//   - operations run in the order they are called; a result that returns a value to the host
//     (a loss sum, a norm) waits for the work before it;
//   - `Bf16Operands*` non-null makes an operation mixed precision (train.precision = bf16): f32
//     operands of its products are rounded to bf16 (nearest even) and accumulated in f32.
// The conformance suite (tests/kernels/conformance_test.cc, docs/performance.md) holds every
// operation of every backend compiled in against an f64 reference.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "core/arena.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/memory.h"
#include "core/param_store.h"

namespace tetra {

/** Scratch for the bf16 copies of a mixed-precision product's f32 operands, owned by the model and
 *  charged to its ledger, on the backend's device. Grows when a product needs more (generation with
 *  a wider batch). */
class Bf16Operands {
 public:
  /** Room for products whose A and B have `elements` elements together. */
  Bf16Operands(Device& device, size_t elements, MemTag tag = {});
  /** The first `a` and the next `b` elements of the scratch, grown to a + b if needed. */
  std::pair<bf16*, bf16*> take(size_t a, size_t b);

  /** Keeps bf16 copies of the `n` parameters at `base` (the store's flat f32 buffer) for the
   *  products that read them, charged to `tag`: each range is rounded once, at the first product
   *  that reads it after invalidate_weights(), instead of at every product (a weight is read by
   *  every micro-batch's forward and input-gradient products). */
  void keep_weights(const float* base, size_t n, MemTag tag = {});
  /** A pass begins: the parameters may have changed since the last one, so every kept copy is
   *  stale except those the last update wrote (rounded_by_update). */
  void invalidate_weights() { fresh_ = updated_; }
  /** The kept copies, indexed as the parameters at `base`; null unless `base` is the buffer they
   *  copy. An optimizer that writes them while it updates (Kernels::adamw_update) then names the
   *  ranges it wrote with rounded_by_update(). */
  bf16* weight_copies(const float* base) {
    return base_ && base == base_ ? weights_.data() : nullptr;
  }
  /** The update just wrote the copies of these parameter ranges (param_pos, count), and nothing
   *  else changes the parameters before the next update: they stay fresh through every
   *  invalidation until then. Replaces the previous update's ranges. */
  void rounded_by_update(const std::vector<OwnedSegment>& segments);
  /** The kept copy of the `extent` parameters from `first`, and whether the caller must round
   *  them into it first (they then count as fresh); {nullptr, false} when they are not kept. */
  std::pair<bf16*, bool> weights(const float* first, size_t extent);

 private:
  // Disjoint ranges of parameter offsets, begin -> end, adjacent ones merged.
  using Ranges = std::map<size_t, size_t>;
  static void add(Ranges& ranges, size_t begin, size_t end);
  static bool covers(const Ranges& ranges, size_t begin, size_t end);

  Buffer<bf16> mem_;
  const float* base_ = nullptr;
  Buffer<bf16> weights_;
  Ranges fresh_;    // copies current in this pass
  Ranges updated_;  // copies the last update wrote
};

/** A batched 2-D operand: dims (b0, b1, rows, cols) with element strides for each dim. */
struct MatOperand {
  const void* data = nullptr;
  std::array<int64_t, 4> strides{};  // (b0, b1, row, col)
  DType dtype = DType::f32;
};

/** C = A·B (+ bias) (+ C) over batch dims (b0, b1). A and B may be f32 or bf16 with f32 C and bias,
 *  or all f64 (the reference loop, for gradient checks). */
struct MatmulArgs {
  int64_t b0 = 1, b1 = 1;  // batch dims
  int64_t M = 0, N = 0, K = 0;
  MatOperand a;       // (b0, b1, M, K)
  MatOperand b;       // (b0, b1, K, N)
  void* c = nullptr;  // (b0, b1, M, N), f32 (f64 with f64 operands)
  std::array<int64_t, 4> c_strides{};
  const void* bias = nullptr;   // (N), same dtype as C; only with b0 == b1 == 1
  bool accumulate = false;      // C += A·B instead of C = A·B
  const char* role = "matmul";  // its name in the per-kernel profile (core/profile.h)
  // Mixed precision: f32 A and B are rounded to bf16 in this scratch and multiplied with f32
  // accumulation into f32 C (null: an f32 product).
  Bf16Operands* bf16 = nullptr;
};

template <typename T>
constexpr DType dtype_of() {
  return sizeof(T) == 8 ? DType::f64 : DType::f32;
}

/** Causal self-attention over a fused qkv buffer (B,T,W) laid out [q | k | v]: q is (NH, hs) with
 *  hs = C/NH, k and v are (KVH, hs) each, W = C + 2·KVH·hs. Grouped-query attention (KVH < NH,
 *  KVH dividing NH): query head h reads key/value head h / (NH/KVH). KVH = 0 means NH (multi-head
 *  attention, W = 3C). C, NH and KVH are this rank's (divided by tp under tensor parallelism). */
struct AttentionShape {
  int B = 0, T = 0, C = 0, NH = 0, KVH = 0;
  int kv_heads() const { return KVH > 0 ? KVH : NH; }
  int head_size() const { return C / NH; }
  int kv_width() const { return kv_heads() * head_size(); }               // columns of k (and of v)
  int64_t width() const { return int64_t(C) + 2 * int64_t(kv_width()); }  // W: a row of qkv
};

/** Rows of a (B, T, ·) activation inside a larger buffer: element (b, t, j) is
 *  p[b·batch + t·row + j]. Blockwise attention reads its chunks of q, k and v, and writes its
 *  outputs, through these, so a chunk of a fused qkv buffer or of a received key/value block is
 *  addressed where it lies. */
template <typename P>
struct Rows {
  P* p = nullptr;
  int64_t row = 0, batch = 0;
};

/** One block of blockwise (ring) attention, context parallelism (docs/context_parallel.md): the
 *  Tq queries of one chunk of each of B sequences against the Tk keys and values of another chunk
 *  of the same sequences. C, NH and KVH as in AttentionShape (this rank's heads): q rows are
 *  (NH, hs), k and v rows (KVH, hs), hs = C/NH, query head h reads key/value head h / (NH/KVH).
 *  causal: the two chunks are the same positions (Tq == Tk) and key j is visible to query i iff
 *  j <= i; otherwise every key is visible (a chunk wholly before the queries). The scale is
 *  1/sqrt(hs), as attention_forward's. */
struct AttentionBlock {
  int B = 0, Tq = 0, Tk = 0, C = 0, NH = 0, KVH = 0;
  bool causal = false;
  int kv_heads() const { return KVH > 0 ? KVH : NH; }
  int head_size() const { return C / NH; }
};

/** A contiguous run [offset, offset + count) of a flat buffer. */
struct FlatRange {
  size_t offset = 0, count = 0;
};

/** An in-place reduction of n values over the tensor-parallel group (sum or max). */
template <typename F>
using GroupReduce = std::function<void(F* values, int64_t n)>;

/** One AdamW update (torch.optim.AdamW semantics: bias correction, decoupled decay). */
struct AdamWStep {
  float lr;
  float grad_scale;  // gradients are multiplied by this first (global-norm clipping, fused)
  float beta1, beta2, eps;
  float weight_decay;  // applied only to segments with decay set
  int64_t t;           // 1-based step count for bias correction
};

inline constexpr double kLayerNormEps = 1e-5;  // GPT-2's

template <typename F>
class Kernels {
 public:
  virtual ~Kernels() = default;

  // ---- memory ---------------------------------------------------------------------------------
  /** dst (n) = src (n). */
  virtual void copy(F* dst, const F* src, size_t n) = 0;
  /** x (n) = 0. */
  virtual void zero(F* x, size_t n) = 0;
  /** dst (rows, cols) with row stride dst_stride = src (rows, cols) with row stride src_stride. */
  virtual void copy_rows(F* dst, int64_t dst_stride, const F* src, int64_t src_stride, int64_t rows,
                         int64_t cols) = 0;

  // ---- products -------------------------------------------------------------------------------
  /** C = A·B (+ bias) (+ C), MatmulArgs above. */
  virtual void matmul(const MatmulArgs& args) = 0;
  /** Independent products run as one group (a mixture of experts' experts, each with its own
   *  weight and rows): the CPU backend spreads the whole group's work over its threads at once
   *  instead of each product over all of them in turn. The default runs them one after the
   *  other. */
  virtual void matmul_group(std::span<const MatmulArgs> products) {
    for (const MatmulArgs& p : products) matmul(p);
  }
  /** A column-parallel MLP input product with its bias and GELU: pre (M,N) = inp (M,K) · w^T +
   *  bias (N), w (N,K); out (M,N) = gelu(pre). pre is kept for backward. */
  virtual void linear_gelu(F* out, F* pre, const F* inp, const F* w, const F* bias, int64_t M,
                           int64_t N, int64_t K, const char* role, Bf16Operands* bf16) = 0;

  // ---- LayerNorm over the channel dimension, eps kLayerNormEps --------------------------------
  /** out (N,C); mean and rstd (N) saved for backward; inp (N,C); weight, bias (C). */
  virtual void layernorm_forward(F* out, F* mean, F* rstd, const F* inp, const F* weight,
                                 const F* bias, int64_t N, int C) = 0;
  /** dinp (N,C), dweight and dbias (C) accumulate. */
  virtual void layernorm_backward(F* dinp, F* dweight, F* dbias, const F* dout, const F* inp,
                                  const F* weight, const F* mean, const F* rstd, int64_t N,
                                  int C) = 0;

  // ---- RMSNorm over the channel dimension (Llama) ---------------------------------------------
  /** out (N,C) = inp · rstd · weight with rstd (N) = 1/sqrt(mean over C of inp² + eps), saved for
   *  backward; inp (N,C), weight (C). */
  virtual void rmsnorm_forward(F* out, F* rstd, const F* inp, const F* weight, int64_t N, int C,
                               double eps) = 0;
  /** dinp (N,C) and dweight (C) accumulate. */
  virtual void rmsnorm_backward(F* dinp, F* dweight, const F* dout, const F* inp, const F* weight,
                                const F* rstd, int64_t N, int C) = 0;

  // ---- rotary position embedding (Llama; Hugging Face's rotate_half convention) ---------------
  /** Rotates, in place, the q and k heads of qkv (B,T,W) (AttentionShape): in each head the pairs
   *  (i, i + hs/2), i < hs/2, of the token at position pos0 + t turn by the angle
   *  (pos0 + t) · theta^(-2i/hs), computed in double. `inverse` turns by the opposite angle: the
   *  backward of the rotation, applied to dqkv. v is untouched; hs must be even. */
  virtual void rope(F* qkv, const AttentionShape& s, int pos0, double theta, bool inverse) = 0;

  // ---- causal self-attention ------------------------------------------------------------------
  /** Elements forward keeps for backward per micro-batch ("saved"): the CPU's probabilities
   *  (B,NH,T,T), a flash kernel's row log-sum-exp (B,NH,T). */
  virtual size_t attention_saved_elements(const AttentionShape& s) const = 0;
  /** Elements of backward's scratch. */
  virtual size_t attention_scratch_elements(const AttentionShape& s) const = 0;
  /** bf16 elements a mixed-precision call takes from its Bf16Operands. */
  virtual size_t attention_bf16_elements(const AttentionShape& s) const = 0;
  /** out (B,T,C) = softmax(q·k^T / sqrt(hs), causal) · v over qkv (B,T,W); `saved` receives what
   *  backward reads. */
  virtual void attention_forward(F* out, F* saved, const F* qkv, const AttentionShape& s,
                                 Bf16Operands* bf16) = 0;
  /** `saved` alone, as attention_forward leaves it (selective recomputation, in backward). */
  virtual void attention_recompute(F* saved, const F* qkv, const AttentionShape& s,
                                   Bf16Operands* bf16) = 0;
  /** dqkv (B,T,W) overwritten from dout (B,T,C); out is forward's output, saved its state;
   *  scratch is attention_scratch_elements long. */
  virtual void attention_backward(F* dqkv, F* scratch, const F* dout, const F* qkv, const F* out,
                                  const F* saved, const AttentionShape& s, Bf16Operands* bf16) = 0;
  /** Scratch elements of attention_decode for B sequences of up to maxT positions. */
  virtual size_t attention_decode_scratch_elements(int B, int NH, int maxT) const = 0;
  /** Generation: the keys and values of the s.T new positions pos0.. of qkv (B,T,W) are written
   *  into kcache and vcache (B,maxT,KVH·hs): the cache holds only the key/value heads; each new
   *  query attends to cached positions 0..its own. out (B,T,C). */
  virtual void attention_decode(F* out, const F* qkv, F* kcache, F* vcache, F* scratch, int pos0,
                                const AttentionShape& s, int maxT) = 0;

  // ---- blockwise attention (context parallelism: a sequence's chunks on several ranks) --------
  // A query chunk's attention is the online-softmax merge of its blocks against every key chunk
  // it can see, in any order; backward needs only the merged output and log-sum-exp.
  /** Elements of the scratch the two calls below take for block b. */
  virtual size_t attention_block_scratch_elements(const AttentionBlock& b) const = 0;
  /** Merges block b into a running result: out rows (B,Tq,C) and lse rows (B,Tq,NH) hold the
   *  normalised output and the per-head row log-sum-exp (of the scaled scores) of the blocks merged
   *  so far (lse = -inf everywhere: none yet, out's values ignored); afterwards, of those blocks
   *  and b. q rows (B,Tq,C); k and v rows (B,Tk,KVH·hs). */
  virtual void attention_block_forward(Rows<F> out, Rows<F> lse, Rows<const F> q, Rows<const F> k,
                                       Rows<const F> v, const AttentionBlock& b, F* scratch) = 0;
  /** delta rows (B,Tq,NH) = per head, the dot product of dout and out over its hs channels:
   *  the softmax backward's row term, computed once per query chunk. */
  virtual void attention_block_delta(Rows<F> delta, Rows<const F> dout, Rows<const F> out,
                                     const AttentionBlock& b) = 0;
  /** Backward of block b given the merged out's dout, delta and lse: dq rows (B,Tq,C), dk and dv
   *  rows (B,Tk,KVH·hs) accumulate this block's share of their gradients. */
  virtual void attention_block_backward(Rows<F> dq, Rows<F> dk, Rows<F> dv, Rows<const F> dout,
                                        Rows<const F> delta, Rows<const F> lse, Rows<const F> q,
                                        Rows<const F> k, Rows<const F> v, const AttentionBlock& b,
                                        F* scratch) = 0;

  // ---- element-wise (GELU is the tanh form, GPT-2's gelu_new) ---------------------------------
  /** SwiGLU (Llama's MLP): out (N) = silu(gate) · up, silu(x) = x · sigmoid(x). */
  virtual void swiglu_forward(F* out, const F* gate, const F* up, int64_t N) = 0;
  /** dgate (N) and dup (N) overwritten from dout (N); dgate may alias dout. */
  virtual void swiglu_backward(F* dgate, F* dup, const F* dout, const F* gate, const F* up,
                               int64_t N) = 0;
  /** out (N) = gelu(inp (N)). */
  virtual void gelu_forward(F* out, const F* inp, int64_t N) = 0;
  /** dinp (N) = gelu'(inp) * dout (overwrites; dinp may alias dout). */
  virtual void gelu_backward(F* dinp, const F* inp, const F* dout, int64_t N) = 0;
  /** fch (N,OC) += bias (OC); out (N,OC) = gelu(fch). */
  virtual void bias_gelu_forward(F* out, F* fch, const F* bias, int64_t N, int OC) = 0;
  /** dinp (N,OC) = gelu'(inp) * dout (dinp may alias dout); dbias (OC) accumulates the column
   *  sums of dinp. */
  virtual void gelu_bias_backward(F* dinp, F* dbias, const F* inp, const F* dout, int64_t N,
                                  int OC) = 0;
  /** dbias (OC) accumulates the column sums of dout (N,OC). */
  virtual void bias_backward(F* dbias, const F* dout, int64_t N, int OC) = 0;
  /** out (N,C) += residual (N,C) + bias (C). */
  virtual void residual_bias_add(F* out, const F* residual, const F* bias, int64_t N, int C) = 0;
  /** y (n) += x (n). */
  virtual void add(F* y, const F* x, size_t n) = 0;

  // ---- mixture of experts: token rows to experts and back (model/moe.h) ----------------------
  /** out (rows,C): row i = in[idx[i]], zeros where idx[i] < 0; idx (rows). */
  virtual void gather_rows(F* out, const F* in, const int32_t* idx, int64_t rows, int C) = 0;
  /** out (N,C) accumulates, for every token t and choice j < k with p = pos[t·k+j] >= 0,
   *  gate[t·k+j] · in[p] (gate null: 1), in choice order; in (rows,C), pos and gate (N,k). */
  virtual void moe_combine(F* out, const F* in, const int32_t* pos, const F* gate, int64_t N, int k,
                           int C) = 0;
  /** The combine's backward: for every (t,j) with p = pos[t·k+j] >= 0, din[p] = gate[t·k+j] ·
   *  dout[t] and dgate[t·k+j] = dout[t] · in[p]; dgate is 0 where p < 0, rows of din that no
   *  pos names are left as they are. */
  virtual void moe_combine_backward(F* din, F* dgate, const F* dout, const F* in,
                                    const int32_t* pos, const F* gate, int64_t N, int k, int C) = 0;

  // ---- embedding ------------------------------------------------------------------------------
  /** out (B,T,C) = wte[tokens (B,T)] + wpe[pos0 + t]. wte is rows [v0, v0+Vl) of the vocabulary
   *  (Vl <= 0: every row, v0 = 0); a token outside them contributes zero. wpe may be null. */
  virtual void embedding_forward(F* out, const int32_t* tokens, const F* wte, const F* wpe, int B,
                                 int T, int C, int pos0, int v0, int Vl) = 0;
  /** dwte (rows as above) and dwpe (T,C) accumulate dout (B,T,C); dwpe may be null. */
  virtual void embedding_backward(F* dwte, F* dwpe, const F* dout, const int32_t* tokens, int B,
                                  int T, int C, int v0, int Vl) = 0;
  /** out (rows,C) += wpe[(first_row + i) mod T] for row i: positions of rows [first_row,
   *  first_row + rows) of a (B·T) token sequence (sequence parallelism). */
  virtual void add_positions(F* out, const F* wpe, int64_t first_row, int64_t rows, int T,
                             int C) = 0;

  // ---- softmax + cross-entropy over a padded vocabulary ---------------------------------------
  /** losses (N); logits (N,Vp) whose first V columns are real (padding never wins); targets (N).
   *  With `backward`, logits are overwritten with dloss * (softmax - onehot) in the first V
   *  columns and 0 in the padding. Returns the sum of losses. */
  virtual double softmax_xent(F* losses, F* logits, const int32_t* targets, int64_t N, int V,
                              int Vp, bool backward, F dloss) = 0;
  /** Vocabulary-parallel (Megatron): logits (N,Vl) are columns [v0, v0+Vl) of the padded
   *  vocabulary whose first V columns are real; the row maxima, then the sums of exponentials and
   *  the target logits go through all_max and all_sum (N and 2N values), so no rank holds a whole
   *  row. losses (N) is the full loss on every rank. Returns the sum of losses. */
  virtual double softmax_xent_vocab_parallel(F* losses, F* logits, const int32_t* targets,
                                             int64_t N, int Vl, int v0, int V, bool backward,
                                             F dloss, const GroupReduce<F>& all_max,
                                             const GroupReduce<F>& all_sum) = 0;

  // ---- optimizer and reductions ---------------------------------------------------------------
  /** One AdamW update of every segment (positions in params, grads and the state m, v); gradients
   *  are read-only and multiplied by s.grad_scale on the fly. Non-null `rounded` (indexed as
   *  params) also receives each updated parameter rounded to bf16 (nearest even, NaN kept): the
   *  mixed-precision products' copy of the weights, written in the same pass (f32 only). */
  virtual void adamw_update(F* params, const F* grads, F* m, F* v,
                            const std::vector<OwnedSegment>& segments, const AdamWStep& s,
                            bf16* rounded) = 0;
  /** Sum of squares of x (n) in double; deterministic for a given backend and thread count. */
  virtual double sum_squares(const F* x, int64_t n) = 0;
  /** The sum of sum_squares over `ranges` of base, added in their order. */
  virtual double sum_squares(const F* base, const std::vector<FlatRange>& ranges) = 0;
  /** The index of the first of `ranges` of base holding a NaN or an infinity; -1 if none. */
  virtual int64_t first_nonfinite(const F* base, const std::vector<FlatRange>& ranges) = 0;

  // ---- casts ----------------------------------------------------------------------------------
  /** dst (n) = src rounded to bf16 (nearest even, NaN kept). */
  virtual void to_bf16(bf16* dst, const F* src, size_t n) = 0;
  /** dst (n) = widened src * scale. */
  virtual void from_bf16(F* dst, const bf16* src, size_t n, F scale) = 0;
};

// Row-major 2-D products of the common cases. Weights are stored (out, in) as in PyTorch Linear;
// `role` names the product in the per-kernel profile; `bf16` makes it a mixed-precision product.

/** The MatmulArgs of the three products below, to run later or as part of a group. */
template <typename F>
MatmulArgs nt_args(F* out, const F* inp, const F* w, const F* bias, int64_t M, int64_t N, int64_t K,
                   bool accumulate = false, const char* role = "matmul",
                   Bf16Operands* bf16 = nullptr);
template <typename F>
MatmulArgs nn_args(F* out, const F* a, const F* b, int64_t M, int64_t N, int64_t K,
                   bool accumulate = false, const char* role = "matmul",
                   Bf16Operands* bf16 = nullptr);
template <typename F>
MatmulArgs tn_args(F* out, const F* a, const F* b, int64_t M, int64_t N, int64_t K,
                   bool accumulate = false, const char* role = "matmul",
                   Bf16Operands* bf16 = nullptr);

/** out (M,N) = inp (M,K) · w^T, w (N,K), plus bias (N) if given; accumulate adds to out. */
template <typename F>
void matmul_nt(Kernels<F>& k, F* out, const F* inp, const F* w, const F* bias, int64_t M, int64_t N,
               int64_t K, bool accumulate = false, const char* role = "matmul",
               Bf16Operands* bf16 = nullptr);
/** out (M,N) = a (M,K) · b (K,N). */
template <typename F>
void matmul_nn(Kernels<F>& k, F* out, const F* a, const F* b, int64_t M, int64_t N, int64_t K,
               bool accumulate = false, const char* role = "matmul", Bf16Operands* bf16 = nullptr);
/** out (M,N) = a^T · b with a (K,M), b (K,N): the weight-gradient product. */
template <typename F>
void matmul_tn(Kernels<F>& k, F* out, const F* a, const F* b, int64_t M, int64_t N, int64_t K,
               bool accumulate = false, const char* role = "matmul", Bf16Operands* bf16 = nullptr);

}  // namespace tetra
