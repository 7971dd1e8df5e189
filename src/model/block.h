// One GPT-2 transformer block as a module: pre-LayerNorm causal self-attention and a GELU MLP,
// each added to the residual stream. The block registers its twelve tensors with the parameter
// store under their global Hugging Face names and reads them back by id at every call, so the
// same code runs whether the store holds the weights permanently or a ZeRO-3 layer gathers them
// just in time. One forward serves training (saving what backward needs) and generation
// (attending over a key/value cache). Under tensor parallelism (parallel/tensor_parallel.h) the
// block holds its rank's heads and MLP channels: c_attn and c_fc split by columns, both c_proj by
// rows, one all-reduce after each c_proj forward and one after each column-parallel input
// gradient backward. Buffers below hold this rank's part where the comments say local.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/param_store.h"
#include "core/recompute.h"
#include "kernels/cpu/matmul.h"
#include "model/gpt_config.h"
#include "parallel/tensor_parallel.h"

namespace tetra {

/** What one micro-batch's forward through a block leaves for backward. Pointers into memory the
 *  model owns; att is null when the probabilities are recomputed. qkv (B,T,3C/tp), att
 *  (B,NH/tp,T,T), atty (B,T,C/tp), fch and fch_gelu (B,T,4C/tp) are local; ln1 and ln2 (B,T,C)
 *  whole; residual2 (B,T,C) and the LayerNorm statistics (B,T) hold this rank's B·T/tp rows under
 *  sequence parallelism. */
template <typename F>
struct BlockActs {
  F *ln1, *ln1_mean, *ln1_rstd, *qkv, *att, *atty;
  F *residual2, *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_gelu;

  /** Elements of every buffer for micro-batches (B,T), with or without att. */
  static size_t elements(const GptConfig& c, int B, int T, bool with_att);
  /** Carves the buffers out of `p` (elements(...) long). */
  static BlockActs carve(F* p, const GptConfig& c, int B, int T, bool with_att);
};

/** Backward scratch shared by every block: (B,T,C), (B,T,3C/tp), (B,NH/tp,T,T) twice, (B,T,C/tp),
 *  (B,T,4C/tp). att holds recomputed probabilities under selective recomputation. */
template <typename F>
struct BlockScratch {
  F *dln, *dqkv, *datt, *att, *datty, *dfch;
  // Sequence parallelism only (else null): (B,T,C) for gathered gradients and the row-parallel
  // partial sums of forward, and (4,C) for one micro-batch's LayerNorm gradients.
  F *full = nullptr, *norm_grads = nullptr;
  static size_t elements(const GptConfig& c, int B, int T);
  static BlockScratch carve(F* p, const GptConfig& c, int B, int T);
};

/** Keys and values of every position fed so far, for generation: each (B,maxT,C/tp). */
template <typename F>
struct KvCache {
  F *keys = nullptr, *values = nullptr, *scores = nullptr;  // scores: (maxT) scratch
};

template <typename F>
class BlockT {
 public:
  /** Registers "transformer.h.<layer>.*" (this rank's slices of them) in `store`, inside the unit
   *  the caller opened, in the order backward produces their gradients. config.tp == tp.size().
   *  `bf16` (config.bf16) is the scratch of the mixed-precision products. */
  BlockT(const GptConfig& config, int layer, ParamStoreT<F>& store, parallel::TensorParallel& tp,
         cpu::Bf16Operands* bf16 = nullptr);

  // x and y are (B,T,C), y = block(x) (under sequence parallelism this rank's B·T/tp rows of
  // each); `a` receives the activations. With `cache`, the T tokens are positions pos0.. of a
  // sequence whose earlier keys and values are in the cache (a.att is then unused). tmp (B,T,C) is
  // scratch that sequence parallelism needs.
  void forward(const F* x, F* y, const BlockActs<F>& a, int B, int T,
               const KvCache<F>* cache = nullptr, int pos0 = 0, F* tmp = nullptr);
  // dres (B,T,C) (this rank's rows under sequence parallelism): dL/dy in, dL/dx out. x is the
  // block's input, `a` its activations (att null: recomputed into s.att). Parameter gradients
  // accumulate (+=).
  void backward(F* dres, const F* x, const BlockActs<F>& a, const BlockScratch<F>& s, int B, int T);

  int layer() const { return layer_; }

 private:
  // `role` names the product in the per-kernel profile.
  void row_parallel(F* out, const F* residual, const F* inp, TensorId w, TensorId b, int64_t BT,
                    int K, F* tmp, const char* role);
  void norm_gather(F* out, F* mean, F* rstd, const F* x, TensorId w, TensorId b, int64_t BT,
                   bool sp);

  const GptConfig& c_;
  ParamStoreT<F>& store_;
  parallel::TensorParallel& tp_;
  cpu::Bf16Operands* bf16_;
  int layer_;
  TensorId fcprojw_, fcprojb_, fcw_, fcb_, ln2w_, ln2b_, attprojw_, attprojb_, qkvw_, qkvb_, ln1w_,
      ln1b_;
};

}  // namespace tetra
