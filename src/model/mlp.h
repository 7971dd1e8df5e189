// A block's dense MLP as a part (model/block_spec.h, MlpSpec): GELU (GPT-2's c_fc, c_proj) or
// SwiGLU (Llama's gate_proj and up_proj, then down_proj), added to the residual stream. Under
// tensor parallelism the products into the hidden channels are column-parallel and the output
// projection row-parallel: each rank holds hidden/tp channels, and the MLP costs one all-reduce
// forward (the projection's) and one backward (the norm's before it).
#pragma once

#include <cstddef>
#include <memory>

#include "core/param_store.h"
#include "model/block_spec.h"
#include "model/gpt_config.h"
#include "parallel/tp_layers.h"

namespace tetra {

template <typename F>
class DenseMlp {
 public:
  /** What forward leaves for backward, each (B,T,hidden/tp): pre (GELU's input, or SwiGLU's
   *  gate), up (SwiGLU only) and act, the activation the output projection reads. */
  struct Acts {
    F *pre = nullptr, *up = nullptr, *act = nullptr;
    static size_t elements(const MlpSpec& m, const GptConfig& c, int B, int T);
    static Acts carve(F*& p, const MlpSpec& m, const GptConfig& c, int B, int T);
  };
  /** Backward's scratch, each (B,T,hidden/tp): dpre, and dup (SwiGLU only). */
  struct Scratch {
    F *dpre = nullptr, *dup = nullptr;
    static size_t elements(const MlpSpec& m, const GptConfig& c, int B, int T);
    static Scratch carve(F*& p, const MlpSpec& m, const GptConfig& c, int B, int T);
  };

  /** Registers the part's tensors (this rank's slices) in env.store in backward order: the
   *  output projection, then up, then the input (gate) product. */
  DenseMlp(const GptConfig& c, const MlpSpec& spec, const parallel::LayerEnv<F>& env);

  /** out = residual + mlp(ln) (rows as the residual stream holds them; tmp (B,T,C) for sequence
   *  parallelism); ln (B,T,C) the norm's output, whole. */
  void forward(F* out, const F* residual, const F* ln, const Acts& a, int64_t BT, F* tmp);
  /** dres: dL/d(out) (this rank's rows). dln (B,T,C) is overwritten with this rank's partial
   *  gradient of ln; the weights' gradients accumulate. */
  void backward(F* dln, const F* dres, const F* ln, const Acts& a, const Scratch& s, int64_t BT,
                F* tmp);

 private:
  MlpSpec spec_;
  parallel::LayerEnv<F> env_;
  int hidden_;  // this rank's channels
  std::unique_ptr<parallel::RowParallelLinear<F>> down_;
  std::unique_ptr<parallel::ColumnParallelLinear<F>> up_, in_;  // up: SwiGLU only
};

}  // namespace tetra
