// One transformer block as a module: pre-norm causal self-attention and an MLP, each added to the
// residual stream. A GPT-2 block has LayerNorms, a fused c_attn with biases and a GELU MLP; a
// Llama block (docs/llama.md) RMSNorms, q_proj, k_proj and v_proj writing one fused qkv
// activation that rotary embeddings turn in place, grouped-query attention and a SwiGLU MLP
// (gate_proj and up_proj, then down_proj), with no biases. The block registers its tensors with
// the parameter store under their global Hugging Face names and is made of tensor-parallel layers
// (parallel/tp_layers.h) that read them back by id at every call, so the same code runs whether
// the store holds the weights permanently or a ZeRO-3 layer gathers them just in time. One forward
// serves training (saving what backward needs) and generation (attending over a key/value cache).
// Under tensor parallelism the block holds its rank's heads and MLP channels: the products into
// q, k, v and the MLP's hidden channels are column-parallel (q, k and v by key/value-head groups,
// so a rank holds whole groups), the output projections row-parallel, so attention and the MLP
// each cost one all-reduce forward and one backward. Buffers below hold this rank's part where
// the comments say local.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/param_store.h"
#include "kernels/kernels.h"
#include "model/gpt_config.h"
#include "model/moe.h"
#include "parallel/expert_parallel.h"
#include "parallel/tp_layers.h"

namespace tetra {

/** The sizes of attention's backend-private buffers for micro-batches (B,T) (kernels/kernels.h):
 *  what forward saves for backward, backward's scratch, and decoding's scratch. */
struct AttentionSizes {
  size_t saved = 0, scratch = 0;
  /** The backend's attention, or context-parallel attention across `cp` (null: none). */
  template <typename F>
  static AttentionSizes of(Kernels<F>& k, const GptConfig& c, int B, int T,
                           const parallel::ContextAttention<F>* cp = nullptr);
};

/** What one micro-batch's forward through a block leaves for backward. Pointers into memory the
 *  model owns; attn (attention's saved state) is null when it is recomputed. qkv (B,T,W) (W =
 *  config.local_qkv_width(); after the rotary embedding in a Llama block), atty (B,T,C/tp), fch,
 *  fch_up and fch_gelu (B,T,ffn/tp) are local; ln1 and ln2 (B,T,C) whole; residual2 (B,T,C) and
 *  the norms' statistics (B,T) hold this rank's B·T/tp rows under sequence parallelism. fch is
 *  GPT-2's pre-GELU or Llama's gate, fch_up Llama's up (null in GPT-2), fch_gelu the activation
 *  (GELU, or SwiGLU) that the output projection reads; the means are a LayerNorm's only (null in
 *  Llama). A MoE block has `moe` and a `route` (which the model owns) instead of the fch buffers.
 */
template <typename F>
struct BlockActs {
  F *ln1, *ln1_mean = nullptr, *ln1_rstd, *qkv, *attn, *atty;
  F *residual2, *ln2, *ln2_mean = nullptr, *ln2_rstd;
  F *fch = nullptr, *fch_up = nullptr, *fch_gelu = nullptr;
  MoeActs<F> moe;
  MoeRoute* route = nullptr;

  /** Elements of every buffer for micro-batches (B,T), with `saved` elements of attention state
   *  (0: recomputed), of a MoE block of shape `moe` (null: a dense block). */
  static size_t elements(const GptConfig& c, int B, int T, size_t saved,
                         const MoeShape* moe = nullptr);
  /** Carves the buffers out of `p` (elements(...) long). */
  static BlockActs carve(F* p, const GptConfig& c, int B, int T, size_t saved,
                         const MoeShape* moe = nullptr);
};

/** Backward scratch shared by every block: (B,T,C), (B,T,W), attention's backward scratch and a
 *  recomputed saved state, (B,T,C/tp), (B,T,ffn/tp) and in a Llama model dup (B,T,ffn/tp). */
template <typename F>
struct BlockScratch {
  F *dln, *dqkv, *attn_scratch, *attn_saved, *datty, *dfch, *dup = nullptr;
  // Sequence parallelism only (else null): (B,T,C) for gathered gradients and the row-parallel
  // partial sums of forward, and (4,C) (Llama: (2,C)) for one micro-batch's norm gradients.
  F *full = nullptr, *norm_grads = nullptr;
  MoeScratch<F> moe;  // a model with MoE blocks only
  static size_t elements(const GptConfig& c, int B, int T, const AttentionSizes& a);
  static BlockScratch carve(F* p, const GptConfig& c, int B, int T, const AttentionSizes& a);
};

/** What a block's forward is for (a MoE block's routing statistics and capacity follow it). */
using BlockPass = MoePass;

/** Keys and values of every position fed so far, for generation: each (B,maxT,KVH·hs/tp). */
template <typename F>
struct KvCache {
  F *keys = nullptr, *values = nullptr, *scratch = nullptr;  // scratch: the decode kernel's
};

template <typename F>
class BlockT {
 public:
  /** Registers "transformer.h.<layer>.*" (Llama: "model.layers.<layer>.*"; this rank's slices of
   *  them) in env.store, inside the unit the caller opened, in the order backward produces their
   *  gradients. config.tp ==
   *  env.tp.size(). A MoE block (config.is_moe(layer)) registers its router here and takes the
   *  ids of its experts, which the caller registered in a unit of their own, and their
   *  expert-parallel group. */
  BlockT(const GptConfig& config, int layer, const parallel::LayerEnv<F>& env,
         parallel::ExpertParallel* ep = nullptr,
         std::vector<typename MoeMlp<F>::ExpertIds> experts = {});

  // x and y are (B,T,C), y = block(x) (under sequence parallelism this rank's B·T/tp rows of
  // each); `a` receives the activations (a.attn: attention's saved state, or scratch for it).
  // With `cache`, the T tokens are positions pos0.. of a sequence whose earlier keys and values
  // are in the cache. tmp (B,T,C) is scratch that sequence parallelism (and a MoE block under it)
  // needs. `pass` says what a MoE block's routing is for (with `cache`: decoding).
  void forward(const F* x, F* y, const BlockActs<F>& a, int B, int T,
               const KvCache<F>* cache = nullptr, int pos0 = 0, F* tmp = nullptr,
               BlockPass pass = BlockPass::train);
  // dres (B,T,C) (this rank's rows under sequence parallelism): dL/dy in, dL/dx out. x is the
  // block's input, `a` its activations (attn null: recomputed into s.attn_saved). Parameter
  // gradients accumulate (+=); a MoE block's router losses enter with weight loss_scale.
  void backward(F* dres, const F* x, const BlockActs<F>& a, const BlockScratch<F>& s, int B, int T,
                float loss_scale = 1.0f);

  int layer() const { return layer_; }
  /** The MoE MLP; null in a dense block. */
  MoeMlp<F>* moe() { return moe_.get(); }
  /** The model's BlockScratch, parts of which forward uses too: a MoE block's under expert
   *  parallelism, context-parallel attention's (attn_scratch). */
  void set_forward_scratch(const BlockScratch<F>& s) {
    moe_scratch_ = s.moe;
    attn_scratch_ = s.attn_scratch;
  }

 private:
  // The block's tensors, registered before the layers that use them are built. GPT-2: c_attn is
  // qkvw, c_fc fcw; Llama: q_proj is qkvw, gate_proj fcw, up_proj upw, the projections' outputs
  // attprojw (o_proj) and fcprojw (down_proj), and every bias -1.
  struct Ids {
    TensorId fcprojw = -1, fcprojb = -1, fcw = -1, fcb = -1, upw = -1, router = -1;
    TensorId ln2w, ln2b = -1, attprojw, attprojb = -1, qkvw, qkvb = -1, kw = -1, vw = -1, ln1w,
                   ln1b = -1;
  };
  static Ids register_tensors(const GptConfig& c, int layer, const parallel::LayerEnv<F>& env);
  static Ids register_llama(const GptConfig& c, int layer, const parallel::LayerEnv<F>& env);
  void moe_forward(F* y, const BlockActs<F>& a, int B, int T, F* tmp, BlockPass pass);
  // Whether attention runs across a context-parallel group.
  bool context_parallel() const { return env_.cp && env_.cp->cp() > 1; }
  // The rotary embedding of qkv (B,T,W) at positions pos0.. (or, under context parallelism, this
  // rank's positions); inverse for the gradient.
  void rope(F* qkv, const AttentionShape& shape, int pos0, bool inverse);
  void moe_backward(F* dln, const F* dres, const BlockActs<F>& a, const BlockScratch<F>& s, int B,
                    int T, float loss_scale);

  const GptConfig& c_;
  parallel::LayerEnv<F> env_;
  int layer_;
  Ids ids_;
  parallel::ParallelNorm<F> ln1_, ln2_;
  parallel::ColumnParallelLinear<F> c_attn_, c_fc_;  // Llama: q_proj, gate_proj
  parallel::RowParallelLinear<F> attn_proj_, mlp_proj_;
  std::unique_ptr<parallel::ColumnParallelLinear<F>> k_proj_, v_proj_, up_proj_;  // Llama only
  parallel::NormGradSum<F> norm_grads_;
  std::unique_ptr<MoeMlp<F>> moe_;
  MoeScratch<F> moe_scratch_;
  F* attn_scratch_ = nullptr;
};

}  // namespace tetra
