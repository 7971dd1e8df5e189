// A block's causal self-attention as a part (model/block_spec.h, AttentionSpec): the products into
// q, k and v (one fused product or three), the rotary embedding where the spec asks for it,
// attention over this rank's heads (across a context-parallel group, or over a key/value cache
// when decoding) and the output projection added to the residual stream. Under tensor parallelism
// the q, k, v products are column-parallel by key/value-head groups (a rank holds whole groups and
// the query heads that read them) and the output projection row-parallel: one all-reduce forward
// (the projection's) and one backward (the norm's before it).
#pragma once

#include <cstddef>
#include <memory>

#include "core/param_store.h"
#include "kernels/kernels.h"
#include "model/block_spec.h"
#include "model/gpt_config.h"
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

/** Keys and values of every position fed so far, for generation: each (B,maxT,KVH·hs/tp). */
template <typename F>
struct KvCache {
  F *keys = nullptr, *values = nullptr, *scratch = nullptr;  // scratch: the decode kernel's
};

template <typename F>
class SelfAttention {
 public:
  /** What forward leaves for backward: qkv (B,T,W) (W = config.local_qkv_width(), after the
   *  rotary embedding), attention's saved state (null when it is recomputed) and its output atty
   *  (B,T,C/tp). */
  struct Acts {
    F *qkv = nullptr, *saved = nullptr, *atty = nullptr;
    static size_t elements(const GptConfig& c, int B, int T, size_t saved);
    static Acts carve(F*& p, const GptConfig& c, int B, int T, size_t saved);
  };
  /** Backward's scratch: dqkv (B,T,W), attention's scratch and a recomputed saved state, datty
   *  (B,T,C/tp). Forward uses `attn_scratch` too under context parallelism. */
  struct Scratch {
    F *dqkv = nullptr, *attn_scratch = nullptr, *attn_saved = nullptr, *datty = nullptr;
    static size_t elements(const GptConfig& c, int B, int T, const AttentionSizes& a);
    static Scratch carve(F*& p, const GptConfig& c, int B, int T, const AttentionSizes& a);
  };

  /** Registers the part's tensors (this rank's slices) in env.store, in the order backward
   *  produces their gradients: the output projection, then v, k, q (or the fused qkv). */
  SelfAttention(const GptConfig& c, const AttentionSpec& spec, const parallel::LayerEnv<F>& env);

  /** out = x + attention(ln) (rows as the residual stream holds them; tmp (B,T,C) for sequence
   *  parallelism). ln (B,T,C) is the norm's output, whole. With `cache` the T tokens are
   *  positions pos0.. of sequences whose earlier keys and values are in it. */
  void forward(F* out, const F* x, const F* ln, const Acts& a, int B, int T,
               const KvCache<F>* cache, int pos0, F* tmp, F* attn_scratch);
  /** dres: dL/d(out) (this rank's rows). dln (B,T,C) is overwritten with this rank's partial
   *  gradient of ln (the norm's backward sums the group's); the weights' gradients accumulate. */
  void backward(F* dln, const F* dres, const F* ln, const Acts& a, const Scratch& s, int B, int T,
                F* tmp);

 private:
  // Whether attention runs across a context-parallel group.
  bool context_parallel() const { return env_.cp && env_.cp->cp() > 1; }
  // The rotary embedding of qkv (B,T,W) at positions pos0.. (or, under context parallelism, this
  // rank's positions); inverse for the gradient.
  void rope(F* qkv, const AttentionShape& shape, int pos0, bool inverse);

  const GptConfig& c_;
  AttentionSpec spec_;
  parallel::LayerEnv<F> env_;
  std::unique_ptr<parallel::RowParallelLinear<F>> out_;
  std::unique_ptr<parallel::ColumnParallelLinear<F>> v_, k_, qkv_;  // qkv: q alone, or fused
};

}  // namespace tetra
