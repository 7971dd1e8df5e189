// The token and position embedding as a module: wte (Vp,C), whose rows past the real vocabulary
// are padding (never drawn, absent from files), and in GPT-2 wpe (maxT,C) (a Llama model has no
// learned positions: its blocks rotate q and k). wte is also a tied LM head's weight
// (model/head.h reads it by id). Under tensor parallelism wte is vocabulary-parallel
// (parallel/tp_layers.h): a rank holds rows [r·Vp/tp, (r+1)·Vp/tp), looks up the tokens that fall
// in them and the lookups are summed over the group; wpe is whole and added once.
#pragma once

#include <cstdint>

#include "core/param_store.h"
#include "model/gpt_config.h"
#include "parallel/tp_layers.h"

namespace tetra {

template <typename F>
class EmbeddingT {
 public:
  /** Registers wpe (GPT-2) then wte inside the caller's open unit (wte's gradient is finished
   *  last), or wpe only when the caller registered wte (`wte` >= 0; wte_spec) in a unit of its
   *  own. */
  EmbeddingT(const GptConfig& config, const parallel::LayerEnv<F>& env, TensorId wte = -1);

  // out (B,T,C) = wte[tokens] + wpe[pos0 + t]; tokens is (B,T) on the device. Under sequence
  // parallelism out is this rank's B·T/tp rows and tmp (B,T,C) scratch for the lookups before
  // their reduce-scatter.
  void forward(F* out, const int32_t* tokens, int B, int T, int pos0 = 0, F* tmp = nullptr) {
    lookup_.forward(out, tokens, B, T, pos0, tmp);
  }
  // dwte (this rank's rows) and dwpe accumulate dout (B,T,C) (under sequence parallelism this
  // rank's rows, gathered into tmp (B,T,C) first).
  void backward(const F* dout, const int32_t* tokens, int B, int T, F* tmp = nullptr) {
    lookup_.backward(dout, tokens, B, T, tmp);
  }

  TensorId wte() const { return wte_; }
  /** wte's registration (name, shape, init, this rank's vocabulary slice): also the spec of the
   *  tied copy a pipeline's last stage holds for its head, which therefore starts equal. */
  static ParamSpec wte_spec(const GptConfig& config, const parallel::TensorParallel& tp);

 private:
  TensorId wpe_, wte_;
  parallel::VocabParallelEmbedding<F> lookup_;
};

}  // namespace tetra
