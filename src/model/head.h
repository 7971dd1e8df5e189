// The language-model head as a module: the final LayerNorm and the logits through the tied
// embedding matrix, with the fused softmax cross-entropy. It registers ln_f and reads wte, which
// the embedding owns, by id. Under tensor parallelism the head uses the embedding's vocabulary
// slice: each rank computes its (B,T,Vp/tp) block of logits and the loss is vocabulary-parallel
// (kernels/cpu/cross_entropy.h), so no rank holds whole rows of logits.
#pragma once

#include <cstdint>
#include <vector>

#include "core/param_store.h"
#include "kernels/cpu/matmul.h"
#include "model/gpt_config.h"
#include "parallel/tensor_parallel.h"

namespace tetra {

/** What the head's forward leaves for its backward: lnf (B,T,C), its mean and rstd (B,T; this
 *  rank's B·T/tp rows under sequence parallelism), the
 *  logits (B,T,Vp/tp) (overwritten by their gradient in backward) and per-token losses (B,T). */
template <typename F>
struct HeadActs {
  F *lnf, *lnf_mean, *lnf_rstd, *logits, *losses;
  static size_t elements(const GptConfig& c, int B, int T);
  static HeadActs carve(F* p, const GptConfig& c, int B, int T);
};

template <typename F>
class HeadT {
 public:
  /** Registers ln_f inside the caller's open unit; `wte` is the tied embedding's id. `bf16`
   *  (config.bf16) is the scratch of the mixed-precision products. */
  HeadT(const GptConfig& config, ParamStoreT<F>& store, TensorId wte, parallel::TensorParallel& tp,
        cpu::Bf16Operands* bf16 = nullptr);

  // x (B,T,C) (this rank's rows under sequence parallelism) -> logits (B,T,Vp/tp) in a.logits:
  // every row, this rank's columns.
  void forward(const F* x, const HeadActs<F>& a, int B, int T);
  // The mean loss over the (B,T) targets; logits untouched.
  double loss(const int32_t* targets, const HeadActs<F>& a, int B, int T);
  // After forward: the mean loss, and dres (B,T,C) = dL/dx for d(L)/d(mean loss) = loss_scale.
  // dln (B,T,C) is scratch, and tmp (B,T,C) too under sequence parallelism (where x and dres are
  // this rank's B·T/tp rows). Accumulates the gradients of ln_f and wte.
  double backward(F* dres, F* dln, const F* x, const int32_t* targets, const HeadActs<F>& a, int B,
                  int T, float loss_scale, F* tmp = nullptr);

 private:
  // The loss over this rank's columns; with backward, the logits become their gradient.
  double xent(const int32_t* targets, F* logits, F* losses, int64_t BT, bool backward, F dloss);

  const GptConfig& c_;
  ParamStoreT<F>& store_;
  parallel::TensorParallel& tp_;
  cpu::Bf16Operands* bf16_;
  TensorId lnfw_, lnfb_, wte_;
  std::vector<F> norm_grads_;  // (2,C): one micro-batch's ln_f gradients (sequence parallelism)
};

}  // namespace tetra
