// The language-model head as a module: the final norm (GPT-2's ln_f LayerNorm, Llama's model.norm
// RMSNorm) and the logits through the tied embedding matrix or an untied lm_head, with the fused
// softmax cross-entropy. It registers the norm (and an untied lm_head.weight) and reads a tied
// wte, which the embedding owns, by id. Under tensor parallelism the head is a column-parallel
// product over the embedding's vocabulary slice: each rank computes its (B,T,Vp/tp) block of logits
// and the loss is vocabulary-parallel, so no rank holds whole rows of logits.
#pragma once

#include <cstdint>

#include "core/param_store.h"
#include "model/gpt_config.h"
#include "parallel/tp_layers.h"

namespace tetra {

/** What the head's forward leaves for its backward: lnf (B,T,C), its mean (LayerNorm only; else
 *  null) and rstd (B,T; this rank's B·T/tp rows under sequence parallelism), the logits (B,T,Vp/tp)
 * (overwritten by their gradient in backward) and per-token losses (B,T). */
template <typename F>
struct HeadActs {
  F *lnf, *lnf_mean = nullptr, *lnf_rstd, *logits, *losses;
  static size_t elements(const GptConfig& c, int B, int T);
  static HeadActs carve(F* p, const GptConfig& c, int B, int T);
};

template <typename F>
class HeadT {
 public:
  /** Registers an untied lm_head.weight (config.tie_embeddings false; `wte` -1) and the final
   *  norm inside the caller's open unit; `wte` is the tied embedding's id otherwise. */
  HeadT(const GptConfig& config, const parallel::LayerEnv<F>& env, TensorId wte);

  // x (B,T,C) (this rank's rows under sequence parallelism) -> logits (B,T,Vp/tp) in a.logits:
  // every row, this rank's columns.
  void forward(const F* x, const HeadActs<F>& a, int B, int T);
  // The mean loss over the (B,T) targets (device memory); logits untouched.
  double loss(const int32_t* targets, const HeadActs<F>& a, int B, int T);
  // After forward: the mean loss, and dres (B,T,C) = dL/dx for d(L)/d(mean loss) = loss_scale.
  // dln (B,T,C) is scratch, and under sequence parallelism (where x and dres are this rank's
  // B·T/tp rows) tmp (B,T,C) and norm_grads (2,C) too. Accumulates the gradients of ln_f and wte.
  double backward(F* dres, F* dln, const F* x, const int32_t* targets, const HeadActs<F>& a, int B,
                  int T, float loss_scale, F* tmp = nullptr, F* norm_grads = nullptr);

 private:
  const GptConfig& c_;
  parallel::LayerEnv<F> env_;
  TensorId lm_head_w_, lnfw_, lnfb_;
  parallel::ParallelNorm<F> ln_f_;
  parallel::ColumnParallelLinear<F> lm_head_;
  parallel::VocabParallelCrossEntropy<F> xent_;
  parallel::NormGradSum<F> norm_grads_;
};

}  // namespace tetra
