// The token and position embedding as a module: wte (Vp,C), whose rows past the real vocabulary
// are padding (never drawn, absent from files), and wpe (maxT,C). wte is also the tied LM head's
// weight (model/head.h reads it by id).
#pragma once

#include <cstdint>

#include "core/param_store.h"
#include "model/gpt_config.h"

namespace tetra {

template <typename F>
class EmbeddingT {
 public:
  /** Registers wpe then wte inside the caller's open unit (wte's gradient is finished last). */
  EmbeddingT(const GptConfig& config, ParamStoreT<F>& store);

  // out (B,T,C) = wte[tokens] + wpe[pos0 + t]; tokens is (B,T).
  void forward(F* out, const int32_t* tokens, int B, int T, int pos0 = 0);
  // dwte and dwpe accumulate dout (B,T,C).
  void backward(const F* dout, const int32_t* tokens, int B, int T);

  TensorId wte() const { return wte_; }

 private:
  const GptConfig& c_;
  ParamStoreT<F>& store_;
  TensorId wpe_, wte_;
};

}  // namespace tetra
