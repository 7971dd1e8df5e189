// Tensor-parallel layers (Megatron-LM; seed 004 "テンソル並列"): the building blocks the model's
// modules are made of, each holding the ids of its tensors in the parameter store (this rank's
// slices of them), the tensor-parallel group and the backend's kernels. They are where the
// conjugate operators f and g of parallel/tensor_parallel.h live:
//
//   ParallelNorm          a LayerNorm (GPT-2) or RMSNorm (Llama) over this rank's token rows
//                         (all of them without sequence parallelism) whose output is gathered for
//                         the column-parallel products after it (f forward under SP); its backward
//                         reduces the partial input gradient those products return (f backward:
//                         all-reduce, or reduce-scatter under SP).
//   ColumnParallelLinear  y (BT, N/tp) = x (BT, K) · W_r^T + b_r: W split by output rows; y may be
//                         columns of a wider activation (Llama's q, k and v into one qkv).
//   RowParallelLinear     y = residual + Σ_r x_r (BT, K/tp) · W_r^T + b: W split by input columns,
//                         the partial products summed over the group (g: all-reduce, or
//                         reduce-scatter into this rank's rows under SP).
//   VocabParallelEmbedding  wte split by vocabulary rows; lookups summed over the group (g).
//   VocabParallelCrossEntropy  the loss over logits split by vocabulary columns.
//   NormGradSum           under SP, the norms' weight (and bias) gradients of one micro-batch
//                         summed over the group in a single all-reduce.
//
// With one rank every operator is a no-op or a copy, so the same layers run unsplit models.
// Products name themselves in the per-kernel profile as "<name> forward", "<name> weight grad"
// and "<name> input grad".
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/param_store.h"
#include "kernels/kernels.h"
#include "kernels/weight_grads.h"
#include "parallel/context_parallel.h"
#include "parallel/tensor_parallel.h"

namespace tetra::parallel {

/** What a tensor-parallel layer computes with. `bf16` (mixed precision) is the scratch of its
 *  products' bf16 operands, null in fp32. */
template <typename F>
struct LayerEnv {
  ParamStoreT<F>& store;
  TensorParallel& tp;
  Bf16Operands* bf16 = nullptr;
  // Context parallelism (null: none): the sequence's chunks this rank holds and attention across
  // the cp group. Positions of the rows come from its split.
  ContextAttention<F>* cp = nullptr;
  // Where weight-gradient products go (kernels/weight_grads.h): run at once, or kept for a
  // zero-bubble schedule's W (null: always at once).
  WeightGrads<F>* weight_grads = nullptr;
  Kernels<F>& kernels() const { return tp.backend().template kernels<F>(); }
  void weight_product(const MatmulArgs& product) const { weight_products({&product, 1}); }
  /** Runs weight-gradient `products` (one group when `grouped`), or keeps them for W. */
  void weight_products(std::span<const MatmulArgs> products, bool grouped = false) const {
    if (weight_grads) {
      weight_grads->run(products, grouped);
    } else if (grouped) {
      kernels().matmul_group(products);
    } else {
      for (const MatmulArgs& p : products) kernels().matmul(p);
    }
  }
};

/** Where the LayerNorms of one module put their weight and bias gradients. Without sequence
 *  parallelism, the store's gradients. With it each rank's LayerNorms saw only its rows: one
 *  micro-batch's gradients go to `slots` (C each, in `tensors` order), begin() zeroes them and
 *  finish() sums them over the group in one all-reduce and adds them to the store's. */
template <typename F>
class NormGradSum {
 public:
  NormGradSum(const LayerEnv<F>& env, std::vector<TensorId> tensors, int C);
  /** Zeroes the slots (sequence parallelism); call before a backward. */
  void begin(F* slots);
  /** Where the gradient of tensors[i] accumulates during the backward. */
  F* grad(size_t i);
  /** Sums the slots over the group into the store's gradients (sequence parallelism). */
  void finish();

 private:
  LayerEnv<F> env_;
  std::vector<TensorId> tensors_;
  int C_;
  F* slots_ = nullptr;
};

template <typename F>
class ParallelNorm {
 public:
  /** A LayerNorm (eps kLayerNormEps) with a bias; an RMSNorm with epsilon `rms_eps` when `bias`
   *  is -1. */
  ParallelNorm(const LayerEnv<F>& env, TensorId weight, TensorId bias, int C, double rms_eps = 0);
  /** The norm of x, this rank's N rows (N = BT, or BT/tp under sequence parallelism), into its
   *  rows of out (BT,C), then gathered so that every rank holds all BT rows. mean (a LayerNorm's
   *  only) and rstd (N). */
  void forward(F* out, F* mean, F* rstd, const F* x, int64_t BT);
  /** dout (BT,C) is this rank's partial gradient of the output (from column-parallel products):
   *  summed over the group (in place without sequence parallelism; into `tmp`, this rank's N
   *  rows, with it), then dx (N,C) accumulates the norm's input gradient and the weight (and a
   *  LayerNorm's bias) gradients accumulate where `grads` says (tensors `wi` and `wi + 1`). */
  void backward(F* dx, F* dout, const F* x, const F* mean, const F* rstd, int64_t BT, F* tmp,
                NormGradSum<F>& grads, size_t wi);
  TensorId weight() const { return w_; }
  TensorId bias() const { return b_; }

 private:
  LayerEnv<F> env_;
  TensorId w_, b_;
  int C_;
  double rms_eps_;
};

/** What both parallel linear layers hold: the weight (N, K) and bias ids of this rank's part, and
 *  the names of their products in the per-kernel profile. */
template <typename F>
class ParallelLinear {
 protected:
  ParallelLinear(const LayerEnv<F>& env, const std::string& name, TensorId w, TensorId b, int K,
                 int N);
  LayerEnv<F> env_;
  std::string forward_role_, weight_role_, input_role_;
  TensorId w_, b_;
  int K_, N_;
};

template <typename F>
class ColumnParallelLinear : ParallelLinear<F> {
 public:
  /** y (BT, N) = x (BT, K) · W^T + b, W (N, K) this rank's rows of the weight, b (N) or -1. y and
   *  its gradient have row stride `ld` (0: N): N columns of a wider activation. */
  ColumnParallelLinear(const LayerEnv<F>& env, std::string name, TensorId w, TensorId b, int K,
                       int N, int64_t ld = 0);
  void forward(F* y, const F* x, int64_t BT);
  /** pre (BT,N) = x · W^T + b, y = gelu(pre): the MLP's first product. */
  void forward_gelu(F* y, F* pre, const F* x, int64_t BT);
  /** From dy (BT,N): dW and db accumulate, dx (BT,K) = dy · W (this rank's partial sum), or
   *  dx += dy · W with `accumulate` (several products read the same x). */
  void backward(F* dx, const F* dy, const F* x, int64_t BT, bool accumulate = false);
  /** After forward_gelu: dy (BT,N) is overwritten with the gradient of pre, then as backward. */
  void backward_gelu(F* dx, F* dy, const F* pre, const F* x, int64_t BT);

 private:
  using Base = ParallelLinear<F>;
  using Base::b_, Base::env_, Base::forward_role_, Base::input_role_, Base::K_, Base::N_, Base::w_,
      Base::weight_role_;
  int64_t ld_;
};

template <typename F>
class RowParallelLinear : ParallelLinear<F> {
 public:
  /** y (·, N) = residual + Σ_tp x (BT, K) · W^T + b, W (N, K) this rank's columns of the weight,
   *  b (N) whole, or -1 (none). */
  RowParallelLinear(const LayerEnv<F>& env, std::string name, TensorId w, TensorId b, int K, int N);
  /** Without sequence parallelism y and residual are (BT,N) on every rank (all-reduce; the
   *  residual and the bias are added on one rank only, so that the sum counts them once); with it
   *  they are this rank's BT/tp rows and tmp (BT,N) takes the partial product (reduce-scatter). */
  void forward(F* y, const F* residual, const F* x, int64_t BT, F* tmp);
  /** dy: the gradient of y, this rank's rows (gathered into tmp (BT,N) under sequence
   *  parallelism). dW and db accumulate; dx (BT,K) is overwritten. */
  void backward(F* dx, const F* dy, const F* x, int64_t BT, F* tmp);

 private:
  using Base = ParallelLinear<F>;
  using Base::b_, Base::env_, Base::forward_role_, Base::input_role_, Base::K_, Base::N_, Base::w_,
      Base::weight_role_;
};

template <typename F>
class VocabParallelEmbedding {
 public:
  /** wte (Vl, C) is this rank's vocabulary rows [rank·Vl, (rank+1)·Vl) (all rows with one rank);
   *  wpe (maxT, C) is whole, or -1 (no learned positions). */
  VocabParallelEmbedding(const LayerEnv<F>& env, TensorId wte, TensorId wpe, int C, int Vl);
  /** out (B,T,C) = wte[tokens (B,T)] + wpe[pos0 + t]; under sequence parallelism out is this
   *  rank's B·T/tp rows and tmp (B,T,C) takes the lookups before their reduce-scatter. */
  void forward(F* out, const int32_t* tokens, int B, int T, int pos0, F* tmp);
  /** dwte (this rank's rows) and dwpe accumulate dout (B,T,C) (this rank's rows, gathered into
   *  tmp first, under sequence parallelism). */
  void backward(const F* dout, const int32_t* tokens, int B, int T, F* tmp);

 private:
  LayerEnv<F> env_;
  TensorId wte_, wpe_;
  int C_, Vl_;
};

template <typename F>
class VocabParallelCrossEntropy {
 public:
  /** Logits (BT, Vl) are this rank's columns of the padded vocabulary Vp = Vl·tp, whose first V
   *  are real. */
  VocabParallelCrossEntropy(TensorParallel& tp, int V, int Vl);
  /** losses (BT) and the sum of losses; with `backward` the logits become dloss·(softmax −
   *  onehot) in this rank's real columns, 0 in its padding. targets (BT) on the device. */
  double operator()(F* losses, F* logits, const int32_t* targets, int64_t BT, bool backward,
                    F dloss);

 private:
  TensorParallel& tp_;
  int V_, Vl_;
};

}  // namespace tetra::parallel
