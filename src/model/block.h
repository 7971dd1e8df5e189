// One transformer block assembled from parts chosen once from the model's config
// (model/block_spec.h): a pre-norm causal self-attention (model/attention.h) and a pre-norm MLP —
// dense (model/mlp.h) or a mixture of experts (model/moe.h) — each added to the residual stream.
// The norms are LayerNorms or RMSNorms (parallel::ParallelNorm). The block registers its tensors
// with the parameter store under their global Hugging Face names, in the order backward produces
// their gradients (the MLP, ln_2, attention, ln_1), and its parts are made of tensor-parallel
// layers (parallel/tp_layers.h) that read them back by id at every call, so the same code runs
// whether the store holds the weights permanently or a ZeRO-3 layer gathers them just in time.
// One forward serves training (saving what backward needs) and generation (attending over a
// key/value cache). Under tensor parallelism each part holds its rank's heads and channels;
// under sequence parallelism the residual stream and the norms' inputs hold this rank's B·T/tp
// rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "core/param_store.h"
#include "kernels/kernels.h"
#include "model/attention.h"
#include "model/block_spec.h"
#include "model/gpt_config.h"
#include "model/mlp.h"
#include "model/moe.h"
#include "parallel/expert_parallel.h"
#include "parallel/tp_layers.h"

namespace tetra {

/** What one micro-batch's forward through a block leaves for backward. Pointers into memory the
 *  model owns. ln1 and ln2 (B,T,C) whole; residual2 (B,T,C) and the norms' statistics (B,T)
 *  hold this rank's rows under sequence parallelism (the means a LayerNorm's only). `mlp` is a
 *  dense block's, `moe` and its `route` (which the model owns) a MoE block's. */
template <typename F>
struct BlockActs {
  F *ln1, *ln1_mean = nullptr, *ln1_rstd;
  typename SelfAttention<F>::Acts attn;
  F *residual2, *ln2, *ln2_mean = nullptr, *ln2_rstd;
  typename DenseMlp<F>::Acts mlp;
  MoeActs<F> moe;
  MoeRoute* route = nullptr;

  /** Elements of every buffer of a block shaped `spec` for micro-batches (B,T), with `saved`
   *  elements of attention state (0: recomputed); a MoE block's of shape `moe`. */
  static size_t elements(const BlockSpec& spec, const GptConfig& c, int B, int T, size_t saved,
                         const MoeShape& moe);
  /** Carves the buffers out of `p` (elements(...) long). */
  static BlockActs carve(F* p, const BlockSpec& spec, const GptConfig& c, int B, int T,
                         size_t saved, const MoeShape& moe);
};

/** Backward scratch shared by every block: dln (B,T,C), attention's and a dense MLP's, under
 *  sequence parallelism `full` (B,T,C) for gathered gradients and the row-parallel partial sums
 *  of forward and `norm_grads` (both norms' weights and biases, C each) for one micro-batch's
 *  norm gradients, and the MoE blocks' in a model with any. */
template <typename F>
struct BlockScratch {
  F* dln;
  typename SelfAttention<F>::Scratch attn;
  typename DenseMlp<F>::Scratch mlp;
  F *full = nullptr, *norm_grads = nullptr;
  MoeScratch<F> moe;
  static size_t elements(const GptConfig& c, int B, int T, const AttentionSizes& a);
  static BlockScratch carve(F* p, const GptConfig& c, int B, int T, const AttentionSizes& a);
};

/** What a block's forward is for (a MoE block's routing statistics and capacity follow it). */
using BlockPass = MoePass;

template <typename F>
class BlockT {
 public:
  /** Registers block `layer`'s tensors (this rank's slices of them; model/block_spec.h names
   *  them) in env.store, inside the unit the caller opened. config.tp == env.tp.size(). A MoE
   *  block (config.is_moe(layer)) registers its router here and takes the ids of its experts,
   *  which the caller registered in a unit of their own, and their expert-parallel group. */
  BlockT(const GptConfig& config, int layer, const parallel::LayerEnv<F>& env,
         parallel::ExpertParallel* ep = nullptr,
         std::vector<typename MoeMlp<F>::ExpertIds> experts = {});

  // x and y are (B,T,C), y = block(x) (under sequence parallelism this rank's B·T/tp rows of
  // each); `a` receives the activations (a.attn.saved: attention's saved state, or scratch for
  // it). With `cache`, the T tokens are positions pos0.. of a sequence whose earlier keys and
  // values are in the cache. tmp (B,T,C) is scratch that sequence parallelism (and a MoE block
  // under it) needs. `pass` says what a MoE block's routing is for (with `cache`: decoding).
  void forward(const F* x, F* y, const BlockActs<F>& a, int B, int T,
               const KvCache<F>* cache = nullptr, int pos0 = 0, F* tmp = nullptr,
               BlockPass pass = BlockPass::train);
  // dres (B,T,C) (this rank's rows under sequence parallelism): dL/dy in, dL/dx out. x is the
  // block's input, `a` its activations (attn.saved null: recomputed into s.attn.attn_saved).
  // Parameter gradients accumulate (+=); a MoE block's router losses enter with weight
  // loss_scale.
  void backward(F* dres, const F* x, const BlockActs<F>& a, const BlockScratch<F>& s, int B, int T,
                float loss_scale = 1.0f);

  int layer() const { return layer_; }
  const BlockSpec& spec() const { return spec_; }
  /** The MoE MLP; null in a dense block. */
  MoeMlp<F>* moe() { return moe_.get(); }
  /** The model's BlockScratch, parts of which forward uses too: a MoE block's under expert
   *  parallelism, context-parallel attention's (attn.attn_scratch). */
  void set_forward_scratch(const BlockScratch<F>& s) {
    moe_scratch_ = s.moe;
    attn_scratch_ = s.attn.attn_scratch;
  }

 private:
  // A norm's tensors: its weight and, for a LayerNorm, its bias (else -1).
  static std::pair<TensorId, TensorId> register_norm(const NormSpec& n, int C,
                                                     const parallel::LayerEnv<F>& env);
  void moe_forward(F* y, const BlockActs<F>& a, int B, int T, F* tmp, BlockPass pass);
  void moe_backward(F* dln, const F* dres, const BlockActs<F>& a, const BlockScratch<F>& s, int B,
                    int T, float loss_scale);

  const GptConfig& c_;
  BlockSpec spec_;
  parallel::LayerEnv<F> env_;
  int layer_;
  // The parts, built (and their tensors registered) in this order: backward's.
  std::unique_ptr<DenseMlp<F>> mlp_;  // a dense block's
  std::unique_ptr<MoeMlp<F>> moe_;    // a MoE block's
  std::unique_ptr<parallel::ParallelNorm<F>> ln2_;
  std::unique_ptr<SelfAttention<F>> attn_;
  std::unique_ptr<parallel::ParallelNorm<F>> ln1_;
  std::unique_ptr<parallel::NormGradSum<F>> norm_grads_;
  MoeScratch<F> moe_scratch_;
  F* attn_scratch_ = nullptr;
};

}  // namespace tetra
